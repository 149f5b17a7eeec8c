"""A chat request with image_url parts down to (expanded prompt ids, items), without an engine:
the template's placeholder, the expansion, and the 400s (text-only model, too many images,
a bad image)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

pytest.importorskip("fastapi")

from launch.multimodal.inputs import ImageInputs  # noqa: E402
from launch.multimodal.options import MultiModalOptions  # noqa: E402
from launch.serve.chat import chat_inputs  # noqa: E402
from launch.serve.context import ServerContext  # noqa: E402
from launch.serve.errors import APIError  # noqa: E402
from launch.serve.schemas import ChatCompletionRequest  # noqa: E402
from workers.tokenizer import Tokenizer  # noqa: E402

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
WORDS = ["user", "assistant", "what", "is", "this", "and", "\n", "[UNK]"]
# Qwen2-VL's template, its image branch as it is (trimmed of system prompt and video)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend, vocab_size=backend.get_vocab_size(), chat_template=TEMPLATE)


def _ctx(tmp_path: Path, vision: bool = True, **options: Any) -> ServerContext:
    tok = _tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    cfg: dict[str, Any] = {"image_token_id": ids["<|image_pad|>"],
                           "vision_start_token_id": ids["<|vision_start|>"],
                           "vision_end_token_id": ids["<|vision_end|>"]}
    if vision:
        cfg["vision_config"] = {"spatial_merge_size": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    inputs = ImageInputs.for_model(str(tmp_path), MultiModalOptions(**options))
    engine = SimpleNamespace(tokenizer=tok, max_model_len=100_000, dead_reason=None,
                             llm=SimpleNamespace(image_inputs=lambda: inputs))
    return ServerContext(engine=engine, served_names=["m"], model_path=str(tmp_path))  # type: ignore[arg-type]


def _data_url(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _request(*parts: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": list(parts)}]})


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_become_expanded_placeholders(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    tok = ctx.tokenizer
    pad = tok.token_to_id("<|image_pad|>")
    req = _request(_image(_data_url(56, 56)), {"type": "text", "text": "what is this"},
                   _image(_data_url(100, 37)))
    ids, items = asyncio.run(chat_inputs(ctx, req))
    assert [it.placeholder.length for it in items] == [4, 4]
    assert ids.count(pad) == 8
    for it in items:
        p = it.placeholder
        assert ids[p.offset - 1] == tok.token_to_id("<|vision_start|>")
        assert ids[p.offset:p.offset + p.length] == [pad] * p.length
        assert ids[p.offset + p.length] == tok.token_to_id("<|vision_end|>")
    assert items[0].placeholder.offset < items[1].placeholder.offset


def test_text_only_chat_is_unchanged(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, vision=False)
    ids, items = asyncio.run(chat_inputs(ctx, _request({"type": "text", "text": "what"})))
    assert items == [] and ids


@pytest.mark.parametrize(("vision", "options", "parts", "message"), [
    (False, {}, [_image("data:image/png;base64,AAAA")], "does not accept images"),
    (True, {"limit_mm_per_prompt": {"image": 1}}, [_image("data:,x")] * 2,
     r"at most 1 image\(s\) per prompt"),
    (True, {}, [_image("data:image/png;base64,AAAA")], "cannot decode image"),
    (True, {}, [_image("file:///etc/passwd")], "not allowed"),
    (True, {}, [{"type": "image_url"}], "not supported"),
])
def test_refusals_are_400s(tmp_path: Path, vision: bool, options: dict[str, Any],
                           parts: list[dict[str, Any]], message: str) -> None:
    ctx = _ctx(tmp_path, vision, **options)
    with pytest.raises(APIError, match=message) as e:
        asyncio.run(chat_inputs(ctx, _request(*parts)))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "Traceback" not in e.value.message and "/etc" not in e.value.message
