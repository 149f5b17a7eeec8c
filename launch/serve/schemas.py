"""Request bodies of the OpenAI API as vLLM accepts them (pydantic; unknown fields accepted).

Types are checked here; values (temperature range, token ids, ...) are checked by the engine's
own validation (engine_core.frontend.validation), so a client gets the same message over HTTP as
from the Python API.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    # Unknown fields are accepted and ignored, as vLLM does (clients send provider extras).
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Open):
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    request_id: str | None = None
    # prefix-cache isolation, vLLM's field: only requests with the same salt share blocks
    cache_salt: str | None = Field(default=None, strict=True)
    return_token_ids: bool = False  # vLLM extension: token ids next to the text of each choice
    logit_bias: dict[str, float] | None = None  # typed so it is checked, not ignored
    # the agent job this request is a turn of (--scheduling-policy continuum); strict, so a
    # number is refused rather than turned into a string
    job_id: str | None = Field(default=None, strict=True)
    is_last_step: bool = Field(default=False, strict=True)
    tool_name: str | None = Field(default=None, strict=True)
    # disaggregated prefill / decode, vLLM's field (checked in launch/serve/kv_params.py)
    kv_transfer_params: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True


class ImageURL(_Open):
    url: str
    detail: str | None = None  # OpenAI's; the image processor decides the size here


class TextPart(_Open):
    """A content part: {"type": "text", "text"} or {"type": "image_url", "image_url": {url}}."""

    type: str = "text"
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes BOS itself


class TokenizeRequest(_Open):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content parts joined into one string.

    A message with image parts keeps its parts, as {"type": "image"} and {"type": "text",
    "text"} dicts in order: what HF vision chat templates (Qwen2-VL's) turn into the image
    placeholder ``<|vision_start|><|image_pad|><|vision_end|>``. Raises ValueError for any
    other kind of part.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        content: Any = m.content
        if isinstance(content, list):
            texts = []
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.type == "image_url" and part.image_url is not None:
                    parts.append({"type": "image"})
                    continue
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"content part of type {part.type!r} is not supported (text and "
                        "image_url only)"
                    )
                texts.append(part.text)
                parts.append({"type": "text", "text": part.text})
            has_image = any(p["type"] == "image" for p in parts)
            content = parts if has_image else "\n".join(texts)
        d: dict[str, Any] = dict(m.model_extra or {})
        d.update(role=m.role, content=content or "")
        out.append(d)
    return out


