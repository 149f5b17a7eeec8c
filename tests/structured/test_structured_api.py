"""Structured outputs through the Python API on real processes and real xgrammar.

Random weights produce garbage, so only the constraint can make the output valid: every
output must parse and validate against its schema, match its regex or be one of its choices,
and finish with "stop" when its grammar ends. TP=2 runs with checksums on, so the engine stops
if two ranks ever sampled different tokens (their matchers and masks must agree).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from launch import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.procs import wait_no_descendants
from tests.serve.serve_helpers import make_tokenizer_dir

SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar's length-bounded string rule lets control
        # characters through, which JSON forbids
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe not"]
SAMPLING = [dict(temperature=0.0), dict(temperature=1.0, seed=7), dict(temperature=0.9, top_k=20),
            dict(temperature=1.2, top_p=0.8), dict(temperature=1.0, min_p=0.05)]


def _requests(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json_object=True)]
    prompts, params = [], []
    for i in range(count):
        prompts.append([5 + i % 7, 40 + i % 11, 6, 7, 8, 5 + i % 7, 40 + i % 11, 6])
        params.append(SamplingParams(max_tokens=120, structured_outputs=specs[i % len(specs)],
                                     **SAMPLING[i % len(SAMPLING)]))  # type: ignore[arg-type]
    return prompts, params


def _check(text: str, spec: StructuredOutputsParams) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif spec.choice is not None:
        assert text in CHOICES, text
    else:
        assert isinstance(json.loads(text), dict), text


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


def _engine(tok_dir: str, **options: Any) -> LLM:
    return LLM(model="dummy:micro", tokenizer=tok_dir, kv_cache_memory=16 * 2**20, **options)


@pytest.mark.parametrize("options", [
    dict(tensor_parallel_size=1),
    dict(tensor_parallel_size=2, enable_checksum=True),
    dict(tensor_parallel_size=1, speculative_ngram=2, num_speculative_tokens=3),
    dict(tensor_parallel_size=1, async_scheduling=True),
], ids=["tp1", "tp2", "ngram", "async"])
def test_constrained_outputs_are_valid(tok_dir: str, options: dict[str, Any]) -> None:
    prompts, params = _requests(50)
    try:
        with _engine(tok_dir, **options) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, timeout_s=240)
            plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                              ignore_eos=True),
                                 use_tqdm=False, timeout_s=60)
            stats = llm.get_stats() if options.get("speculative_ngram") else {}
    finally:
        assert wait_no_descendants(20) == []
    for o, sp in zip(outs, params, strict=True):
        assert o.text is not None
        if sp.structured_outputs.json_object:  # type: ignore[union-attr]
            # an unbounded object may run to max_tokens on random weights
            assert o.finish_reason in ("stop", "length"), o.error
            if o.finish_reason == "length":
                assert o.text.startswith("{"), o.text
                continue
        assert o.finish_reason == "stop", (o.finish_reason, o.error, o.text)
        _check(o.text, sp.structured_outputs)  # type: ignore[arg-type]
    assert plain[0].finish_reason == "length" and len(plain[0].token_ids) == 4
    if stats:  # drafts were proposed and verified against the masks
        assert stats.get("spec_num_draft_tokens", 1) > 0


def test_bad_constraints_are_refused_and_the_engine_keeps_serving(tok_dir: str) -> None:
    bad = {
        "json": StructuredOutputsParams(json='{"type": "objec"}'),
        "json: Expecting": StructuredOutputsParams(json="{not json"),
        "regex": StructuredOutputsParams(regex="[a-"),
        "grammar": StructuredOutputsParams(grammar="root ::= "),
        "choice": StructuredOutputsParams(choice=[]),
        "one constraint": StructuredOutputsParams(regex="a", choice=["a"]),
    }
    try:
        with _engine(tok_dir) as llm:
            for what, spec in bad.items():
                with pytest.raises(ValueError, match=what):
                    llm.generate([[5, 6]], SamplingParams(structured_outputs=spec),
                                 use_tqdm=False, timeout_s=60)
            ok = llm.generate([[5, 6]], SamplingParams(
                temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
                use_tqdm=False, timeout_s=60)
    finally:
        assert wait_no_descendants(20) == []
    assert ok[0].text in ("a", "b") and ok[0].finish_reason == "stop"
