"""Reading a request body safely: bounded in bytes, strict JSON, bounded nesting, valid Unicode.

Every way a body can be hostile is answered here with a 4xx before the body is typed: a body
past `--max-request-bytes` is a 413 (refused from Content-Length before it is read, or as soon
as a chunked body passes the bound); broken JSON, nesting deeper than MAX_DEPTH and strings with
lone surrogates (JSON's "\\ud800" escapes decode to str values that cannot be encoded as UTF-8
later, in the tokenizer or a response) are 400s naming the field. Surrogates are refused, not
replaced: a silently altered prompt would give the client tokens it did not ask for.

Large bodies are parsed and walked in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from launch.serve import DEFAULT_MAX_REQUEST_BYTES
from launch.serve.errors import APIError, bad_request

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "check_content_type", "parse_json_object",
           "parse_request", "read_body"]

# deeper than any request schema (a chat message's content part is 4 levels down)
MAX_DEPTH = 32
# below this the thread hop costs more than parsing on the loop
PARSE_IN_THREAD_BYTES = 64 * 1024
# a list of a million wrong values is one error to the client, not a megabyte of text
MAX_REPORTED = 3

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError as e:
            raise bad_request(f"invalid Content-Length header {declared!r}") from e
        if size > max_bytes:
            raise _too_large(size, max_bytes)
    chunks: list[bytes] = []
    got = 0
    async for chunk in request.stream():
        got += len(chunk)
        if got > max_bytes:  # chunked or lying about its length: stop reading now
            raise _too_large(got, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, at_least: bool = False) -> APIError:
    # a chunked body is refused as soon as it passes the bound: its size is not known
    size_text = "" if at_least else f" ({size} bytes)"
    return APIError(
        413,
        f"request body{size_text} is over the limit of {max_bytes} bytes (--max-request-bytes)",
    )


async def parse_request(raw: bytes, model: type[M]) -> M:
    """The body as `model`, or a 400 naming the first bad field."""
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(_typed, raw, model)
    return _typed(raw, model)


async def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, checked like every typed body (strict JSON, depth bounded,
    valid Unicode) but not typed: for a proxy that forwards what it was sent."""
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(json_object, raw)
    return json_object(raw)


def check_content_type(request: Request) -> None:
    """400 unless the body is declared as JSON (a form or text body is never parsed)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {ctype or 'none'!r}")


def _typed(raw: bytes, model: type[M]) -> M:
    data = json_object(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        parts = []
        param = None
        for err in e.errors(include_url=False)[:MAX_REPORTED]:
            loc = ".".join(str(x) for x in err["loc"])
            param = param or (str(err["loc"][0]) if err["loc"] else None)
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        raise bad_request("; ".join(parts), param) from e


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, or a 400: malformed, not an object, too deep, bad Unicode.

    json.loads recurses in C and stops with RecursionError near Python's recursion limit, and
    the body is already bounded in bytes, so parsing a hostile body costs at most that much;
    check_tree then refuses anything deeper than MAX_DEPTH."""
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise bad_request(f"malformed JSON body: nested deeper than {MAX_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    check_tree(data)
    return data


def check_tree(data: dict[str, Any]) -> None:
    """Depth and Unicode of every value; iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_str(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise bad_request(
                    f"{path}: JSON nested deeper than {MAX_DEPTH} levels", _field(path)
                )
            if isinstance(value, dict):
                for k, v in value.items():
                    sub = f"{path}.{k}" if path else str(k)
                    _check_str(k, sub)
                    if isinstance(v, (str, dict, list)):
                        stack.append((v, sub, depth + 1))
            else:
                for i, v in enumerate(value):
                    if isinstance(v, (str, dict, list)):
                        stack.append((v, f"{path}[{i}]", depth + 1))


def _check_str(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{path}: string holds a lone surrogate ({s[e.start]!r} at position {e.start}), "
            "which is not valid Unicode",
            _field(path),
        ) from e


def _field(path: str) -> str | None:
    """The top-level field a path starts in: what the error's `param` names."""
    head = path.split(".", 1)[0].split("[", 1)[0]
    return head or None
