"""Value checks of request fields the engine's own validation does not see: chat messages,
logit_bias, logprobs counts, max_tokens against max_model_len, stop strings, request ids, and a
prompt's length in characters before it is tokenized.

Each failure is a 400 whose `param` names the field (and whose message names the exact spot,
e.g. `messages[2].role`).
"""

from __future__ import annotations

import math
from typing import Any

from launch.serve.errors import bad_request
from launch.serve.schemas import ChatMessage

# The roles OpenAI's chat API defines; a template may not know what to do with any other.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# vLLM's default max_logprobs. The engine returns the sampled token's logprob only, so every
# count in range gets that one entry.
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value
# Every stop string is searched for in each new piece of text and the longest one sets how much
# text is held back from a stream, so both the count and the length are bounded (OpenAI allows
# 4 strings; these leave room for clients that send more).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256  # it names the request in every log line and response


def check_messages(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ROLES:
            raise bad_request(
                f"{where}.role: unknown role {m.role[:40]!r}; expected one of "
                f"{', '.join(sorted(ROLES))}",
                "messages",
            )
        content = m.content
        if content is None:
            if m.role != "assistant":  # only an assistant turn (e.g. tool calls) may omit it
                raise bad_request(f"{where}.content: a {m.role} message needs content", "messages")
            continue
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type == "image_url" and part.image_url is not None:
                    continue  # its URL is checked where it is fetched (launch/multimodal/)
                if part.type != "text" or not isinstance(part.text, str):
                    raise bad_request(
                        f"{where}.content[{j}]: content part of type {part.type[:40]!r} is not "
                        "supported (text with a `text` string, or image_url with an "
                        "`image_url.url`)",
                        "messages",
                    )


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """Keys must be token ids of the vocabulary, values finite in [-100, 100]. The engine has no
    logit bias, so a valid non-empty map is refused too rather than silently ignored."""
    if not bias:
        return
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab_size:
            raise bad_request(
                f"logit_bias: key {key[:40]!r} is not a token id in [0, {vocab_size})",
                "logit_bias",
            )
        if not math.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
            raise bad_request(
                f"logit_bias[{key}] must be a finite number in [-100, 100], got {value}",
                "logit_bias",
            )
    raise bad_request("logit_bias is not supported by this server", "logit_bias")


def check_max_tokens(value: int, max_model_len: int, param: str) -> None:
    if value < 1:
        raise bad_request(f"{param} must be >= 1, got {value}", param)
    if value > max_model_len:
        raise bad_request(
            f"{param} ({value}) must be <= max_model_len ({max_model_len})", param
        )


def max_token_chars(tokenizer: Any) -> int:
    """The longest token's text in characters (added tokens included).

    Every token covers at most this many characters of input (a byte-level token's string has
    one character per byte, and an input character is at least one byte), so a text longer
    than max_model_len * this cannot fit, whatever it tokenizes to.
    """
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1) or 1


def check_prompt_chars(text: str, limit: int, max_model_len: int, param: str) -> None:
    if len(text) > limit:
        raise bad_request(
            f"{param} is {len(text)} characters long, more than max_model_len "
            f"({max_model_len}) tokens can hold ({limit} characters at most)",
            param,
        )


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stop)} strings, at most {MAX_STOP_STRINGS} allowed",
                          "stop")
    for i, text in enumerate(stop):  # an empty string is ignored, as before
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"stop[{i}] is {len(text)} characters long, at most "
                              f"{MAX_STOP_CHARS} allowed", "stop")


def check_request_id(request_id: str | None) -> None:
    if request_id is not None and not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise bad_request(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got "
                          f"{len(request_id)}", "request_id")
    if request_id is not None and not request_id.isprintable():
        raise bad_request("request_id must be printable text (no control characters)",
                          "request_id")
