"""Process bookkeeping for multi-process tests: nothing a test starts may outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any


def _ppid_map() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'
        rest = stat.rsplit(")", 1)[1].split()
        if rest[0] == "Z":  # zombies are dead, just not reaped yet
            continue
        out[int(name)] = int(rest[1])
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of `pid` (default: this process)."""
    root = os.getpid() if pid is None else pid
    ppids = _ppid_map()
    found: list[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in ppids.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def wait_no_descendants(timeout_s: float = 5.0, pid: int | None = None) -> list[int]:
    """Wait until `pid` has no live descendants; returns those left (killed) on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = descendants(pid)
        if not left:
            return []
        time.sleep(0.05)
    left = descendants(pid)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def run_watched(cmd: list[str], timeout_s: float, **popen_kw: Any) -> tuple[int, list[int]]:
    """Run `cmd` to its end (killed after `timeout_s`), noting every descendant it starts while
    it runs (its children are not ours: once it exits they belong to init, so
    wait_no_descendants cannot see them). Returns its exit status and the descendants still
    alive 10 s after it exited (killed)."""
    proc = subprocess.Popen(cmd, **popen_kw)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            seen.update(descendants(proc.pid))
            proc.kill()
        proc.wait(10)
    grace = time.monotonic() + 10
    while time.monotonic() < grace and any(pid_alive(p) for p in seen):
        time.sleep(0.05)
    left = [p for p in seen if pid_alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, left
