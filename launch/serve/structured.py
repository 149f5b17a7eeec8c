"""Structured-output fields of an HTTP request -> one StructuredOutputsParams.

Accepted shapes (OpenAI's and vLLM's): ``response_format`` {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; vLLM's
``structured_outputs`` {"json" | "regex" | "choice" | "grammar"}; the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. Two constraints at once are a 400.
The constraint is compiled (launch.structured) before the request is queued, so a schema,
regex or grammar the grammar engine refuses is a 400 naming it, and so is one that does not
compile within --structured-outputs-compile-timeout.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import msgspec

from launch.serve.errors import bad_request, public_detail
from launch.serve.generation import Generation
from launch.structured import FrontendGrammars
from protocol.structured import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def request_constraint(extra: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint the request's fields ask for, or None; a 400 for a malformed one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = extra.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        fields = {k: so[k] for k in ("json", "regex", "choice", "grammar", "json_object")
                  if so.get(k) is not None}
        found.append(("structured_outputs", _spec(fields, "structured_outputs")))
    for name, kind in _GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, _spec({kind: extra[name]}, name)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"more than one structured output constraint: {names}", found[1][0])
    return found[0][1] if found else None


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema' "
                              "object", "response_format")
        # OpenAI allows leaving the schema out: then any JSON object
        schema = js.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        return _spec({"json": schema}, "response_format")
    raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                      f"got {kind!r}", "response_format")


def _spec(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    # keyword construction (the struct is array-shaped on the wire); types are checked by
    # protocol.structured.structured_error before anything is compiled
    return StructuredOutputsParams(**fields)


async def constrain(ctx: Any, gen: Generation, spec: StructuredOutputsParams | None,
                    param: str = "structured_outputs") -> None:
    """Compile ``spec`` (off the event loop, cached) and put it on the generation's params."""
    if spec is None:
        return
    if ctx.grammars is None:
        ctx.grammars = FrontendGrammars(ctx.tokenizer, ctx.engine.vocab_size,
                                        ctx.engine.llm.config)
    params = msgspec.structs.replace(gen.params, structured_outputs=spec)
    try:
        pending = ctx.grammars.submit(params)
    except ValueError as e:
        # a failed compile stays cached and its one exception object is raised again for
        # every request with the same constraint, each raise adding this frame (and with it
        # this request's Generation) to its traceback: drop it, or every such request is kept
        e.__traceback__ = None
        raise bad_request(public_detail(str(e)), param) from None
    try:
        # finish() names a timeout; the hold is released whatever happens (a client gone too)
        while not pending.future.done() and pending.remaining() > 0:
            await _wait(pending.future, pending.remaining())
        gen.params = ctx.grammars.finish(params, pending)
    except ValueError as e:
        e.__traceback__ = None  # it may be the compile's own exception, shared (see above)
        raise bad_request(public_detail(str(e)), param) from None
    finally:
        pending.hold.release()


async def _wait(fut: Future[Any], timeout_s: float) -> None:
    """Until ``fut`` is done or ``timeout_s`` passed. Never cancels it (other requests may
    share the compile) and never takes its exception into asyncio (finish() reads it)."""
    if fut.done():
        return
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    fut.add_done_callback(wake)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except TimeoutError:
        pass
