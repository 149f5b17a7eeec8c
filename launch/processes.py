"""Starting and supervising the engine's processes (torchrun-style).

Children get the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) plus TANDEM_CONFIG and TANDEM_ENDPOINTS. Each child:
- runs in its own process group, so a terminal's Ctrl-C reaches only the launcher, which then
  tears everything down in order;
- is killed by the kernel if the launcher dies (PR_SET_PDEATHSIG), so nothing is orphaned even
  when the launcher gets SIGKILL.
A watcher thread polls the children every 50 ms; the first one to exit, when nobody asked it to,
is reported once with a one-line cause and everything else is torn down. The cause includes the
reason the child wrote to its TORCHELASTIC_ERROR_FILE (torchrun's convention), so a rank that
fails before it connects anywhere is still reported as "worker rank 1 (pid P) exited with code 1:
DeviceError: ...", not only by its exit code.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from protocol.config import EngineConfig
from protocol.error_file import ERROR_FILE_ENV, read_error_file
from protocol.transport import Endpoints

WATCH_INTERVAL_S = 0.05
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    name: str  # "engine core" or "worker rank N"
    proc: subprocess.Popen[bytes]
    error_file: str | None = None

    def describe(self, code: int) -> str:
        """"worker rank 1 (pid P) exited with code 1[: the reason it wrote]"."""
        text = f"{self.name} (pid {self.proc.pid}) {describe_exit(code)}"
        reason = read_error_file(self.error_file) if self.error_file else None
        return f"{text}: {reason}" if reason else text


@dataclass
class ProcessGroup:
    """The engine processes one launcher started on this node."""

    children: list[Child] = field(default_factory=list)
    on_failure: Callable[[str], None] | None = None
    failure: str | None = None
    _stopping: bool = False
    _watcher: threading.Thread | None = None
    _error_dir: str | None = None

    def start(self, name: str, module: str, env: Mapping[str, str]) -> Child:
        if self._error_dir is None:
            self._error_dir = tempfile.mkdtemp(prefix="tandem-err-")  # 0700
        error_file = os.path.join(self._error_dir, f"{len(self.children)}.json")
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env={**env, ERROR_FILE_ENV: error_file},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, proc, error_file)
        self.children.append(child)
        return child

    def watch(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="tandem-supervisor", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping:
            for c in self.children:
                code = c.proc.poll()
                if code is not None and not self._stopping:
                    self.failure = c.describe(code)
                    if self.on_failure is not None:
                        self.on_failure(self.failure)
                    self.terminate()
                    return
            time.sleep(WATCH_INTERVAL_S)

    def first_exit(self) -> str | None:
        for c in self.children:
            code = c.proc.poll()
            if code is not None:
                return c.describe(code)
        return None

    def terminate(self, grace_s: float = 2.0) -> None:
        """SIGTERM everyone still alive, then SIGKILL after `grace_s`; reap all."""
        self._stopping = True
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    c.proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)
            self._error_dir = None

    def wait_all(self, timeout_s: float) -> bool:
        """Wait for every child to exit by itself; True when all did."""
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop_watching(self) -> None:
        self._stopping = True

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]


def base_env(config: EngineConfig, endpoints: Endpoints) -> dict[str, str]:
    env = dict(os.environ)
    env["TANDEM_CONFIG"] = msgspec.json.encode(config).decode()
    env.update(endpoints.to_env())
    # Workers set their own torch thread count (cores / local workers).
    env.setdefault("OMP_NUM_THREADS", "1")
    # OMP_WAIT_POLICY is left at libgomp's default on purpose: a worker's OpenMP threads
    # spin briefly at each barrier, then sleep. PASSIVE (sleep at once) costs a futex
    # wake-up per parallel region, hundreds per step: TP=1 bf16 throughput fell from about
    # 4,600 to 3,800 tok/s on a 2-core machine. An idle engine still uses no CPU.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_engine_core(group: ProcessGroup, env: Mapping[str, str], world_size: int) -> Child:
    core_env = dict(env)
    core_env["WORLD_SIZE"] = str(world_size)
    return group.start("engine core", "engine_core", core_env)


def start_workers(
    group: ProcessGroup,
    env: Mapping[str, str],
    *,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> list[Child]:
    world = nproc_per_node * nnodes
    out = []
    for local_rank in range(nproc_per_node):
        rank = node_rank * nproc_per_node + local_rank
        wenv = dict(env)
        wenv.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(nproc_per_node),
            GROUP_RANK=str(node_rank),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        out.append(group.start(f"worker rank {rank}", "workers", wenv))
    return out
