"""The `openai` client sends images as data URLs to a real `python -m launch serve` subprocess
serving a tiny random Qwen2-VL checkpoint (with the tiny WordLevel tokenizer and chat template
of tests/helpers/tiny_vl.py).

- image_url parts become the expanded image placeholders (4 and 12 image tokens for 56x56 and
  84x112 pixels), counted in usage.prompt_tokens; greedy output repeats; another image gives
  another prompt (and, for this random model, other tokens);
- bad images (corrupt data, more than --limit-mm-per-prompt, a file:// URL without
  --allowed-local-media-path) are 400s that say why, without a traceback or a path, and the
  server goes on serving;
- an image sent to a text-only model (dummy:micro, a second short-lived server) is a 400.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_helpers import Server, make_tokenizer_dir, serve

from tests.helpers.tiny_vl import END, IMAGE, START, add_tiny_vl_tokenizer, make_tiny_hf_vl

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

MODEL = "tiny-vl"
EB = {"ignore_eos": True, "return_token_ids": True}
TEXT = "describe the image"
# (height, width) in pixels, multiples of 28: 2x2 and 3x4 merged patches
SIZES = {(56, 56): 4, (84, 112): 12}


def png_url(h: int, w: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = str(tmp_path_factory.mktemp("qwen2_vl"))
    make_tiny_hf_vl(path, "qwen2_vl")
    add_tiny_vl_tokenizer(path)
    with serve("--model", path, "--served-model-name", MODEL, "--kv-cache-memory", "16M",
               "--limit-mm-per-prompt", '{"image": 2}',
               log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=60.0)
    yield c
    c.close()


def chat(client: Any, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                          temperature=0, extra_body=EB)


def test_images_expand_in_prompt_and_greedy_repeats(client: Any) -> None:
    results = {}
    for (h, w), n in SIZES.items():
        r = chat(client, user(image_part(png_url(h, w, seed=1))))
        (c,) = r.choices
        ids = c.prompt_token_ids
        assert ids.count(IMAGE) == n
        start = ids.index(START)
        assert ids[start + 1:start + 2 + n] == [IMAGE] * n + [END]
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == 4 and len(c.token_ids) == 4
        results[(h, w)] = (ids, c.token_ids, c.message.content)
    # the same text, so the prompts differ by the 8 image tokens only
    small, large = results[(56, 56)], results[(84, 112)]
    assert len(large[0]) - len(small[0]) == 8

    again = chat(client, user(image_part(png_url(56, 56, seed=1)))).choices[0]
    assert (again.prompt_token_ids, again.token_ids, again.message.content) == small

    # same size, other pixels: the same prompt ids; the random model reads its images, so the
    # tokens differ for at least one of a few other images
    others = [chat(client, user(image_part(png_url(56, 56, seed=s)))).choices[0]
              for s in (2, 3, 4)]
    assert all(o.prompt_token_ids == small[0] for o in others)
    assert any(o.token_ids != small[1] for o in others)


def test_two_images_in_one_message(client: Any) -> None:
    r = chat(client, user(image_part(png_url(56, 56, 1)), image_part(png_url(84, 112, 1))))
    ids = r.choices[0].prompt_token_ids
    assert ids.count(IMAGE) == 16 and ids.count(START) == ids.count(END) == 2
    assert r.usage.prompt_tokens == len(ids)


BAD = {
    "corrupt": (user(image_part("data:image/png;base64,AAAA")), "cannot decode image"),
    "over-limit": (user(*[image_part(png_url(56, 56, 1))] * 3), "--limit-mm-per-prompt"),
    "file-url": (user(image_part("file:///etc/hostname")), "allowed-local-media-path"),
    "bad-base64": (user(image_part("data:image/png;base64,@@@")), "base64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400_and_the_server_goes_on(client: Any, tmp_path: Any,
                                                   case: str) -> None:
    messages, word = BAD[case]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages)
    assert e.value.status_code == 400
    body = e.value.response.text
    err = e.value.response.json()["error"]
    msg = err["message"]
    assert err["param"] == "messages" and err["code"] == 400
    assert word in msg, msg
    for leak in ("Traceback", "File \"", "/etc/", "/work", "site-packages", str(tmp_path)):
        assert leak not in body, body
    # the next good request is served
    r = chat(client, user(image_part(png_url(56, 56, 1))))
    assert r.choices[0].prompt_token_ids.count(IMAGE) == 4


def test_text_only_chat_on_the_vl_model(client: Any) -> None:
    r = chat(client, [{"role": "user", "content": TEXT}])
    assert IMAGE not in r.choices[0].prompt_token_ids
    assert r.usage.completion_tokens == 4


def test_image_to_a_text_only_model_is_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    with serve("--model", "dummy:micro", "--kv-cache-memory", "16M", "--tokenizer", tok,
               log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0,
                          timeout=60.0)
        try:
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="dummy:micro", max_tokens=2,
                                          messages=user(image_part(png_url(56, 56, 1))))
            assert "image" in e.value.response.json()["error"]["message"]
            r = c.chat.completions.create(model="dummy:micro", max_tokens=2,
                                          messages=[{"role": "user", "content": "hello"}])
            assert r.usage.completion_tokens >= 1
        finally:
            c.close()
