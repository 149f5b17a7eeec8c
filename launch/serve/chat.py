"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from launch.serve.chat_images import fetch_chat_images, with_images
from launch.serve.context import ServerContext
from launch.serve.errors import bad_request, logger, public_detail
from launch.serve.field_checks import check_logprobs, check_messages
from launch.serve.generation import Delta, pad_logprobs, token_text
from launch.serve.respond import respond
from launch.serve.schemas import ChatCompletionRequest, ChatMessage, message_dicts
from launch.serve.structured import constrain, request_constraint
from launch.serve.tool_stream import ToolCallStream
from launch.serve.tools import tool_constraint, with_tool_calls
from protocol.multimodal import MMItem


def chat_prompt(
    ctx: ServerContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int]:
    tok = ctx.tokenizer
    if tok is None or not tok.has_chat_template:
        raise bad_request(
            f"model {ctx.model_path!r} has no chat template: use /v1/completions "
            "(or start the server with a --tokenizer that has one)",
            "messages",
        )
    check_messages(messages)
    try:
        text = tok.render_chat(message_dicts(messages), add_generation_prompt)
    except ValueError as e:
        raise bad_request(public_detail(str(e)), "messages") from e
    except Exception as e:  # noqa: BLE001 - a template's raise_exception or a render error
        # the template's own words help the client; where in the template engine it broke
        # does not (and is logged)
        logger.warning("chat template failed: %s: %s", type(e).__name__, e)
        raise bad_request(f"chat template failed: {public_detail(str(e))}", "messages") from e
    return ctx.encode(text, add_special_tokens, "messages")


async def chat_inputs(ctx: ServerContext, req: ChatCompletionRequest
                      ) -> tuple[list[int], list[MMItem]]:
    """The request's prompt ids (placeholders expanded) and its images' items ([] for text)."""
    check_messages(req.messages)
    images = await fetch_chat_images(ctx, req.messages)  # 400 before any work if refused
    # templating and tokenizing are CPU work: off the event loop
    ids = await asyncio.to_thread(
        chat_prompt, ctx, req.messages, req.add_generation_prompt, req.add_special_tokens
    )
    if not images:
        return ids, []
    return await asyncio.to_thread(with_images, ctx, ids, images)


def _logprobs(tokenizer: Any, ids: list[int], lps: list[float], top: int) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, pad_logprobs(lps, len(ids)), strict=True):
        s = token_text(tokenizer, t)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        # the engine returns the sampled token's logprob only, so that is the top list too
        content.append(entry | {"top_logprobs": [dict(entry)] if top > 0 else []})
    return {"content": content}


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, request: Request
) -> Response:
    ctx.check_model(req.model)
    ctx.check_alive()
    check_logprobs(req.top_logprobs, "top_logprobs")
    ids, mm = await chat_inputs(ctx, req)
    # `is None`, not `or`: max_completion_tokens=0 is a value (refused), not "unset"
    max_tokens: int | None
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    if max_tokens is None:
        max_tokens = max(1, ctx.engine.max_model_len - len(ids))
    want_lp = req.logprobs
    top = req.top_logprobs or 0
    gen = ctx.start_generation("chatcmpl", req, [ids], max_tokens, want_lp, param, mm)
    extra = req.model_extra or {}
    spec, tools = request_constraint(extra), tool_constraint(extra)
    plan = None
    if tools is not None:
        if spec is not None:
            raise bad_request("a forced tool call and a structured output constraint cannot "
                              "be combined", "tool_choice")
        spec, plan = tools
    await constrain(ctx, gen, spec, "tools" if plan is not None else "response_format")
    head = ctx.chunk_head(gen, "chat.completion.chunk")
    tok = ctx.tokenizer
    started: set[int] = set()
    # a forced tool call streams as delta.tool_calls (name, then argument chunks), per choice
    calls: dict[int, ToolCallStream] = {}

    def chunks(deltas: list[Delta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            c = d.choice
            finish = d.finish_reason
            delta: dict[str, Any] = {"content": d.text}
            if plan is not None:
                stream = calls.setdefault(c.index, ToolCallStream(plan))
                entries = stream.feed(d.text)
                delta = {"tool_calls": entries} if entries else {}
                if finish == "stop" and stream.num_calls:
                    finish = "tool_calls"
            if c.index not in started:  # the role rides on the first real token's chunk
                started.add(c.index)
                delta = {"role": "assistant"} | ({"content": None} if plan else {}) | delta
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": _logprobs(tok, d.token_ids, d.logprobs, top) if want_lp else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason if d.finish_reason else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            out.append({"choices": [choice]})
        return out

    def body() -> dict[str, Any]:
        choices = []
        for c in gen.choices:
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": _logprobs(tok, c.token_ids, c.logprobs, top) if want_lp else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice |= {"token_ids": c.token_ids, "prompt_token_ids": c.prompt_ids}
            choices.append(with_tool_calls(choice, plan))
        return (head | {"object": "chat.completion", "choices": choices, "usage": gen.usage()}
                | gen.kv_transfer_fields())

    opts = req.stream_options
    return await respond(
        request,
        gen,
        stream=req.stream,
        head=head,
        chunks=chunks,
        body=body,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
    )
