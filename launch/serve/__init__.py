"""OpenAI-compatible HTTP server: `python -m launch serve` / `tandem serve`.

The web stack (FastAPI, uvicorn, prometheus_client) is the optional extra `serve`; importing
the app without it raises an ImportError that names the extra. The engine core and workers are
started exactly as the launcher starts them (launch.llm.LLM); the HTTP frontend runs in the
launcher's process and drives the engine through launch.serve.engine.AsyncEngine.
"""

from __future__ import annotations

import importlib.util

# the largest request body the API server and the P/D proxy read (--max-request-bytes); here,
# with no web-stack import, so the proxy's and pd's flags can name it before the stack is checked
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

SERVE_EXTRA_HINT = (
    "the OpenAI-compatible server needs the 'serve' extra: "
    "pip install -e '.[serve]' (FastAPI, uvicorn, prometheus_client)"
)


def require_web_stack() -> None:
    """Raise an ImportError naming the extra when any part of the web stack is missing."""
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{SERVE_EXTRA_HINT}; missing: {', '.join(missing)}")
