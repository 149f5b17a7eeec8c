"""A server under test as a process tree: started in its own session, ready once its HTTP
health check answers, stopped with SIGTERM then SIGKILL to the whole tree (including children
that left its process group), and its port waited free before the next server starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from proc_cpu import process_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[vs-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_port_free(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still in use after {timeout_s:.0f}s")
        time.sleep(0.25)


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str]
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    known: set[int] = field(default_factory=set)

    def start(self, timeout_s: float) -> None:
        wait_port_free(self.port, 30)
        log(f"starting {self.name}: {' '.join(self.argv)} (log {self.log_path})")
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=REPO)
        logf.close()
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while True:
            self.remember()
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with code {code} while starting; "
                                   f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s; last lines "
                                   f"of {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(1.0)
        self.remember()
        log(f"{self.name} ready (pid {self.proc.pid}, {len(self.known)} processes)")

    def remember(self) -> None:
        """Every pid ever seen in the tree, so children that left it are still killed."""
        if self.proc is not None:
            self.known.update(process_tree(self.proc.pid))

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        self.remember()
        pids = [p for p in self.known if _alive(p)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not pids:
                break
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, sig)
            for p in pids:
                _signal(p, sig)
            deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 10)
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader
                pids = [p for p in pids if _alive(p)]
                if not pids:
                    break
                time.sleep(0.2)
        if pids:
            log(f"{self.name}: processes {pids} survived SIGKILL")
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        self.known.clear()
        wait_port_free(self.port, 60)
        log(f"{self.name} stopped, port {self.port} free")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie is dead, only not yet reaped


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])
