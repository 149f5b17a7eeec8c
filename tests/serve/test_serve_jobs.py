"""Agent-job fields (job_id, is_last_step, tool_name) through the real `openai` client's
extra_body, against a server running the continuum policy; bad values are a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import Server, make_tokenizer_dir, serve

openai = pytest.importorskip("openai")

ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--served-model-name", "micro",
          "--scheduling-policy", "continuum", "--block-size", "4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    with serve(*ENGINE, "--tokenizer", tok, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


def test_job_turns_pin_and_claim(server: Server) -> None:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    prompt = list(range(5, 30))
    eb: dict[str, Any] = {"job_id": "agent-1", "tool_name": "grep", "ignore_eos": True,
                          "return_token_ids": True}
    r1 = c.completions.create(model="micro", prompt=prompt, max_tokens=4, temperature=0.0,
                              extra_body=eb)
    out = r1.choices[0].model_dump()["token_ids"]
    c.completions.create(model="micro", prompt=prompt + out + [7, 8], max_tokens=4,
                         temperature=0.0, extra_body={"job_id": "agent-1", "is_last_step": True})
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("tandem:continuum_pin_hits{")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1.0, metrics
    chat = c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2, extra_body={"job_id": "agent-2"})
    assert chat.choices[0].finish_reason in ("length", "stop")
    for bad in ({"job_id": 5}, {"job_id": "x" * 257}, {"job_id": "j", "is_last_step": "yes"},
                {"job_id": "j", "tool_name": 3}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="micro", prompt=[1, 2], max_tokens=2, extra_body=bad)
    c.close()
