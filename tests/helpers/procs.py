"""Process bookkeeping for multi-process tests: nothing a test starts may outlive it."""

from __future__ import annotations

import os
import signal
import time


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
