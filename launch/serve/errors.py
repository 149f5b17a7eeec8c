"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Every invalid request is a 400, including the ones FastAPI would answer with its own 422
(validation) or a bare 400 (malformed JSON); the message is the engine's own where the engine's
validation is what refused the request.

What a client reads never carries a traceback, a source path or an exception's internals: an
engine that died is named by what failed (a worker, the engine core, ...), an unexpected error
is a bare 500, and text that comes from deeper down (a worker's error for one request, a
template's or a grammar's) is cut down by public_detail(). The full text goes to the server's
log at ERROR, where an operator reads it.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from launch.admission import RETRY_AFTER_S

logger = logging.getLogger("tandem.serve")


class APIError(Exception):
    """Raised by a handler; becomes an OpenAI error body with this status (and headers)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


# where a Python traceback starts in an error text: everything from here on is for the log
TRACEBACK_MARK = "Traceback (most recent call last)"
# a traceback frame line, `File "/x/y.py", line 3, in f`, wherever it appears
_FRAME = re.compile(r'\s*File "[^"]*", line \d+(?:, in \S+)?')
# a path to source or a compiled module (absolute or relative, POSIX or Windows)
_SOURCE_PATH = re.compile(
    r'(?:[A-Za-z]:)?[\w.~-]*(?:[/\\][\w.@+~-]+)+\.(?:py|pyc|pyx|pyi|so|pyd|cc|cpp|cu|h)\b(?::\d+)?'
)
# room for a useful message (a grammar's or a template's), not for a dump
MAX_DETAIL_CHARS = 500

# why an engine died, in words a client may read: (marker in the reason's first line, text);
# the marker found earliest in the line wins ("undecodable message from the engine core" is
# not the core failing, "engine process worker rank 1 ..." is a worker). The markers are the
# engine's own wording (engine_core/, launch/processes.py, launch/client.py).
_DEATH_CAUSES: tuple[tuple[str, str], ...] = (
    ("has not responded", "a worker process stopped responding"),
    ("engine core", "the engine core process failed"),
    ("undecodable message", "the engine core sent a message the server could not read"),
    ("worker rank", "a worker process failed"),
    ("frontend process died", "the server lost its engine processes"),
    ("shutdown", "the engine was shut down"),
)
# reasons already logged: a dead engine fails every request with the same reason, and the
# log needs it once, not once per request (bounded: an engine dies once per process)
_LOGGED_DEATHS: set[str] = set()
_MAX_LOGGED_DEATHS = 16


def public_detail(text: str) -> str:
    """`text` as a client may read it: no traceback, no frame lines, no source paths, bounded.

    Meant for text from below the HTTP layer (a worker's or the engine's error for one
    request, a chat template's or a grammar compiler's message): its first part is usually
    the useful one ("worker rejected the request: ValueError: ..."), and is kept.
    """
    # bounded before the regexes run: an error text can be a whole dump
    text = text.split(TRACEBACK_MARK, 1)[0][: 8 * MAX_DETAIL_CHARS]
    text = _FRAME.sub("", text)
    text = _SOURCE_PATH.sub("<source>", text)
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    out = "\n".join(lines).strip()
    if len(out) > MAX_DETAIL_CHARS:
        out = out[:MAX_DETAIL_CHARS].rstrip() + " ..."
    return out or "the request failed"


def death_cause(reason: str | None) -> str:
    """What failed, in a few stable words, from an engine's dead_reason."""
    lines = (reason or "").strip().splitlines()
    first = lines[0] if lines else ""
    found = [(first.find(marker), cause) for marker, cause in _DEATH_CAUSES if marker in first]
    return min(found)[1] if found else "the engine stopped"


def engine_dead(reason: str | None) -> APIError:
    """The 503 for a dead engine: what failed, never how (the full reason, often a worker's
    traceback, is logged here once)."""
    key = reason or ""
    if key not in _LOGGED_DEATHS and len(_LOGGED_DEATHS) < _MAX_LOGGED_DEATHS:
        _LOGGED_DEATHS.add(key)
        logger.error("the engine is dead: %s", reason)
    return APIError(503, f"the engine is dead: {death_cause(reason)} (see the server's log)")


def engine_unavailable(what: str, e: BaseException, reason: str | None) -> APIError:
    """503 for an engine round trip (stats, census, LoRA) that got no answer; `reason` is the
    engine's dead_reason, if it is dead."""
    if reason is not None:
        return engine_dead(reason)
    logger.error("%s: the engine did not answer: %s: %s", what, type(e).__name__, e)
    return APIError(503, f"{what}: the engine did not answer in time")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def overloaded(message: str) -> APIError:
    """503 with Retry-After: the queue of waiting requests is full (launch/admission.py)."""
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def error_type(status: int) -> str:
    """vLLM's naming: the status phrase without spaces plus "Error" (BadRequestError, ...)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Server"
    name = phrase.replace(" ", "").replace("-", "")
    # "Internal Server Error" is InternalServerError, not ...ErrorError
    return name if name.endswith("Error") else name + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if TRACEBACK_MARK in message:
        # a last guard: whatever path a traceback took to get here, the client never reads it
        logger.error("an error body carried a traceback (cut): %s", message)
        message = public_detail(message)
    # a message may quote the client's own text; lone surrogates in it must not make the
    # error itself unencodable (a 500 in place of the 400)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending field's name."""
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc)
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug here must still answer in the API's shape; what went wrong (the exception's
        # text, its traceback, the source paths in it) goes to the log, never to the client
        logger.error("unhandled error in %s %s", request.method, request.url.path,
                     exc_info=exc)
        return error_response(500, "internal server error (see the server's log)")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 for unknown paths, 405 for wrong methods: same body shape as every other error.
        return error_response(exc.status_code, str(exc.detail))
