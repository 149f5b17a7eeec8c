"""The ranks' grammar caches under the engine core's budget and compile time limit (TP=2).

Real processes, real xgrammar, dummy:micro with the small test tokenizer. A stream of new
schemas keeps every rank's cache within the budget (plus the grammars live requests hold),
as the ranks report it, and every output still follows its schema. A compile the ranks cannot
finish in time fails its request alone, once, while plain requests keep flowing; the
test-only hook TANDEM_TEST_GRAMMAR_HOLD makes the ranks' compiles wait for a file, so the
compile is slow because the test says so, not because of timing.
"""

from __future__ import annotations

import json
import os
import queue

import jsonschema
import pytest

from launch import LLM, SamplingParams
from launch.client import Sink
from launch.tokenizer import load_tokenizer
from protocol.messages import EngineCoreOutput
from tests.helpers.procs import wait_no_descendants
from tests.serve.serve_helpers import make_tokenizer_dir
from tests.structured.grammar_helpers import params, schema
from workers.sample.grammar import tokenizer_info
from workers.sample.grammar_cache import GrammarCache, grammar_bytes

PLAIN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MICRO = {"model": "dummy:micro", "kv_cache_memory": 16 * 2**20, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


def _finish(sink: Sink, timeout_s: float = 120.0) -> EngineCoreOutput:
    while True:
        for _, out, _ in sink.get(timeout=timeout_s):
            if out.finish_reason is not None:
                return out


def _largest_grammar(tok_dir: str, indices: range) -> int:
    """What the ranks' caches count for the biggest of these schemas (same code, same table)."""
    cache = GrammarCache(lambda: tokenizer_info(load_tokenizer(tok_dir), 512))
    try:
        sizes = []
        for i in indices:
            spec = params(i).structured_outputs
            assert spec is not None
            sizes.append(grammar_bytes(spec.key(), cache.submit(spec, keep=False).result(60)))
        return max(sizes)
    finally:
        cache.close()


def test_ranks_keep_their_grammars_to_the_budget(tok_dir: str) -> None:
    batches, batch = 4, 10  # 40 schemas of ~60 KB: twice the 1 MiB budget
    budget = 2**20
    try:
        with LLM(tokenizer=tok_dir, structured_outputs_cache_mb=1, enable_checksum=True,
                 **MICRO) as llm:
            for b in range(batches):
                ids = range(b * batch, (b + 1) * batch)
                outs = llm.generate([[5, 6, 7]] * batch,
                                    [params(i, max_tokens=160, temperature=0.0) for i in ids],
                                    use_tqdm=False, timeout_s=300)
                for i, out in zip(ids, outs, strict=True):
                    assert out.finish_reason == "stop", (out.finish_reason, out.error)
                    assert out.text is not None
                    jsonschema.validate(json.loads(out.text), schema(i))
            stats = llm.get_stats()
    finally:
        assert wait_no_descendants(20) == []
    assert stats["grammar_cache_evictions"] >= batch
    assert stats["grammar_cache_bytes"] <= budget
    # what each rank itself reported: the budget, plus at most one batch of held grammars
    largest = _largest_grammar(tok_dir, range(batches * batch))
    for rank in (0, 1):
        worst = stats[f"grammar_cache_bytes_max_rank{rank}"]
        assert 0 < worst <= budget + batch * largest, (rank, worst, largest)


def test_a_compile_past_the_limit_fails_alone_on_every_rank(
    tok_dir: str, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = f"{tmp_path}/go"
    monkeypatch.setenv("TANDEM_TEST_GRAMMAR_HOLD", go)  # the workers' compiles wait for it
    try:
        with LLM(tokenizer=tok_dir, structured_outputs_compile_timeout=1.0,
                 enable_checksum=True, **MICRO) as llm:
            client = llm.client
            assert client is not None
            open(go, "w").close()  # load every rank's grammar engine (not a timed compile)
            warm = llm.generate([[5, 6, 7]], params(0, max_tokens=160, temperature=0.0),
                                use_tqdm=False, timeout_s=120)
            assert warm[0].finish_reason == "stop", warm[0].error
            os.remove(go)  # from here the ranks' compiles hang

            # straight to the engine (the frontend's own compile is not held)
            slow_sp = llm._grammars().prepare([params(1, max_tokens=160, temperature=0.0)])[0]
            slow: Sink = queue.Queue()
            client.add_request("slow", [5, 6, 7], slow_sp, slow)
            plain = llm.generate([[5, 6, 7]], PLAIN, use_tqdm=False, timeout_s=120)
            assert plain[0].finish_reason == "length" and len(plain[0].token_ids) == 4
            failed = _finish(slow)
            health = llm.health()
            assert health.num_waiting == 0  # its ticket is settled, nothing held

            open(go, "w").close()  # the stuck compiles end on the ranks: results not kept
            again = llm.generate([[5, 6, 7]], params(1, max_tokens=160, temperature=0.0),
                                 use_tqdm=False, timeout_s=120)
    finally:
        assert wait_no_descendants(20) == []
    assert failed.finish_reason == "error" and not failed.new_token_ids
    assert "within 1 s" in (failed.error or "") and "ranks [0, 1]" in (failed.error or "")
    assert "--structured-outputs-compile-timeout" in (failed.error or "")
    assert health.stats["grammar_compile_timeouts"] == 1
    assert again[0].finish_reason == "stop", again[0].error  # the schema itself is fine
    jsonschema.validate(json.loads(again[0].text or ""), schema(1))
