"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Every invalid request is a 400, including the ones FastAPI would answer with its own 422
(validation) or a bare 400 (malformed JSON); the message is the engine's own where the engine's
validation is what refused the request.
"""

from __future__ import annotations

import logging
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
    return phrase.replace(" ", "").replace("-", "") + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
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
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a bug here must still answer in the API's shape; the traceback goes to the log
        logger.exception("unhandled error in a request")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 for unknown paths, 405 for wrong methods: same body shape as every other error.
        return error_response(exc.status_code, str(exc.detail))
