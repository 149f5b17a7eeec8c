"""Is a peer process still alive? Shared by the engine core and the workers, which both need to
tell a dead peer (the root cause) from the error it left behind."""

from __future__ import annotations

import os


def process_running(pid: int) -> bool:
    """False when `pid` is gone or a zombie (killed, not yet reaped by its launcher)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        # No /proc (not Linux): fall back to signal 0, which cannot see zombies.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
