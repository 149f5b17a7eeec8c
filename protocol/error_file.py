"""A child's last words: why it failed, written where its supervisor reads it after the exit.

Uses torchrun's convention (TORCHELASTIC_ERROR_FILE, the JSON layout of torch.distributed.elastic
`@record`), so the reason reaches our launcher and a real `torchrun` alike. A process that dies
before it can connect to the engine (no CUDA device, bad dtype, missing weights) still gets its
reason to the user instead of only an exit code.
"""

from __future__ import annotations

import json
import os
import time

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MAX_MESSAGE_CHARS = 2000


def write_error_file(message: str, traceback_text: str = "",
                     env: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Record the failure where the supervisor looks (no-op when it set no path)."""
    path = env.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": message[:MAX_MESSAGE_CHARS],
                          "extraInfo": {"py_callstack": traceback_text,
                                        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        pass  # the supervisor still reports the exit code


def read_error_file(path: str) -> str | None:
    """The one-line reason a child wrote, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    msg = record.get("message") if isinstance(record, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    if not isinstance(msg, str) or not msg:
        return None
    return msg.strip().splitlines()[0]
