"""Disaggregated prefill and decode on real engines: a prefill engine (P) computes a prompt and
hands it over; a decode engine (D) pulls the KV rank to rank and generates. Greedy tokens
equal one engine's (fp32) at (P, D) TP = (1, 1), (2, 2), (1, 2), (2, 1), over the TCP pull and
same-host shared memory, for prompts of 1, block - 1, block, block + 1 and many blocks, a
decode-side prefix hit and a full hit; every failure leaves both engines' free blocks at their
totals.

Five engines for the whole module (P TP 1 and 2, D TP 1 over TCP and TP 2 over shared memory,
and a prefill engine with a cluster secret and a short lease that the failure tests end up
killing); every test reuses them.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from launch import LLM, SamplingParams
from launch.outputs import RequestOutput
from protocol.kv_connector import KVTransferConfig, KVTransferParams
from protocol.request_options import RequestOptions
from tests.helpers.procs import wait_no_descendants

pytestmark = pytest.mark.slow  # five engines (seven ranks) for the module

BS = 16
OPTS = dict(load_tokenizer=False, block_size=BS, dtype="float32", enforce_eager=True,
            kv_cache_memory=16 << 20, max_model_len=1024)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = KVTransferParams(do_remote_decode=True)


def _kv(connector: str = "auto", **kw: object) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=connector, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines():
    started: dict[str, LLM] = {}
    old = os.environ.get("TANDEM_SECRET")
    try:
        started["P1"] = LLM("dummy:tiny", 1, kv_transfer_config=_kv(), **OPTS)
        started["P2"] = LLM("dummy:tiny", 2, kv_transfer_config=_kv(), **OPTS)
        started["D1"] = LLM("dummy:tiny", 1, kv_transfer_config=_kv("tcp"), **OPTS)
        started["D2"] = LLM("dummy:tiny", 2, kv_transfer_config=_kv("auto"), **OPTS)
        # its ports speak CURVE under a secret the decode engines do not hold
        os.environ["TANDEM_SECRET"] = "not-the-decode-engines-secret"
        started["P3"] = LLM("dummy:tiny", 1, **OPTS, kv_transfer_config=_kv(
            kv_lease_s=2.0, kv_transfer_timeout_s=1.0))
    finally:
        if old is None:
            os.environ.pop("TANDEM_SECRET", None)
        else:
            os.environ["TANDEM_SECRET"] = old
    try:
        yield started
    finally:
        for e in started.values():
            e.shutdown()
        assert wait_no_descendants(15) == []


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 31000 + 500 for i in range(n)]


def prefill(p: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    outs = p.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                      use_tqdm=False, timeout_s=120, kv_transfer_params=PREFILL)
    assert all(o.kv_transfer_params is not None for o in outs), [o.error for o in outs]
    return outs


def free_blocks(e: LLM) -> int:
    return int(e.get_stats()["num_free_blocks"])


def settled(*engines: LLM, timeout_s: float = 30.0) -> bool:
    """Every engine's free-block count back at its total (leases end a moment after)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(free_blocks(e) == e.info.num_blocks - 1 for e in engines):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("pair", ["P1-D1", "P2-D2", "P1-D2", "P2-D1"])
def test_pd_greedy_equals_one_engine(engines, pair: str) -> None:
    p, d = (engines[k] for k in pair.split("-"))
    seed = sum(map(ord, pair))
    lengths = [1, BS - 1, BS, BS + 1, 7 * BS + 3]
    prompts = [prompt(n, seed + i) for i, n in enumerate(lengths)]
    # the reference: one engine, no P/D, its own prefix cache kept out (another salt)
    ref = engines["P1"].generate(prompts, GREEDY, use_tqdm=False, timeout_s=120,
                                 cache_salt="reference")
    pre = prefill(p, prompts)
    out = d.generate(prompts, GREEDY, use_tqdm=False, timeout_s=120,
                     kv_transfer_params=[o.kv_transfer_params for o in pre])
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in out] == ["length"] * len(out)
    # every prompt token but the last came from P (the last is recomputed on D)
    assert [o.metrics.num_cached_tokens for o in out] == [n - 1 for n in lengths]
    # the decode side really used P's KV: another prompt's KV gives other tokens
    a, b = prompt(3 * BS, seed + 50), prompt(3 * BS, seed + 51)
    wrong = prefill(p, [a])[0].kv_transfer_params
    mixed = d.generate([b], GREEDY, use_tqdm=False, timeout_s=120, kv_transfer_params=wrong)
    own = engines["P1"].generate([b], GREEDY, use_tqdm=False, cache_salt="reference")
    assert mixed[0].token_ids != own[0].token_ids
    assert settled(p, d)


def test_decode_side_prefix_hits(engines) -> None:
    p, d = engines["P1"], engines["D2"]
    full = prompt(6 * BS + 1, 900)  # (len - 1) a multiple of the block: a full hit is possible
    d.generate([full[: 3 * BS + 2]], GREEDY, use_tqdm=False)  # D caches 3 blocks of it
    ref = engines["P1"].generate([full], GREEDY, use_tqdm=False, cache_salt="reference")
    before = d.get_stats()["kv_loaded_tokens"]
    pre = prefill(p, [full])
    out = d.generate([full], GREEDY, use_tqdm=False, kv_transfer_params=pre[0].kv_transfer_params)
    assert out[0].token_ids == ref[0].token_ids
    assert out[0].metrics.num_cached_tokens == len(full) - 1
    assert d.get_stats()["kv_loaded_tokens"] - before == len(full) - 1 - 3 * BS  # the rest
    # a full hit: D computed this prompt already; nothing is pulled, P's lease is released
    pre = prefill(p, [full])
    out = d.generate([full], GREEDY, use_tqdm=False, kv_transfer_params=pre[0].kv_transfer_params)
    assert out[0].token_ids == ref[0].token_ids
    assert d.get_stats()["kv_loaded_tokens"] - before == len(full) - 1 - 3 * BS
    assert settled(p, d)


def test_aborts_leave_both_engines_free(engines) -> None:
    p, d = engines["P2"], engines["D1"]
    text = prompt(20 * BS, 77)
    # before P finishes
    assert p.client is not None and d.client is not None
    import queue

    sink: queue.Queue = queue.Queue()
    p.client.add_request("early", text, SamplingParams(max_tokens=1), sink,
                         options=RequestOptions(kv_transfer_params=PREFILL))
    p.abort(["early"])
    # between P and D, and while D loads: D aborts right after it got the request
    params = prefill(p, [text, prompt(9 * BS, 78)])
    d.client.add_request("late", text, GREEDY, sink,
                         options=RequestOptions(kv_transfer_params=params[0].kv_transfer_params))
    d.abort(["late"])
    d.client.add_request("mid", prompt(9 * BS, 78), GREEDY, sink,
                         options=RequestOptions(kv_transfer_params=params[1].kv_transfer_params))
    time.sleep(0.05)
    d.abort(["mid"])
    # "early" may finish before its abort lands (its lease then waits for a decode that never
    # comes and ends at kv_lease_s, 30 s): wait past that, not just for prompt releases
    assert settled(p, d, timeout_s=75.0)
    # late and duplicate completions were ignored: both engines still serve
    out = d.generate([text], GREEDY, use_tqdm=False, timeout_s=60)
    assert out[0].finish_reason == "length"


def test_lease_expiry_wrong_secret_and_killed_prefill_engine(engines) -> None:
    p3, d = engines["P3"], engines["D1"]
    text = prompt(5 * BS + 1, 31)
    ref = engines["P1"].generate([text], GREEDY, use_tqdm=False, cache_salt="reference")
    # D never arrives: the 2 s lease runs out, the blocks come back
    prefill(p3, [text])
    assert free_blocks(p3) < p3.info.num_blocks - 1
    assert settled(p3)
    assert p3.get_stats()["kv_leases_expired"] == 1
    # a decode engine without the prefill engine's secret is refused; it recomputes
    pre = prefill(p3, [text])
    out = d.generate([text], GREEDY, use_tqdm=False, kv_transfer_params=pre[0].kv_transfer_params)
    assert out[0].token_ids == ref[0].token_ids and out[0].metrics.num_cached_tokens == 0
    failed = d.get_stats()["kv_transfer_failed"]
    assert failed >= 1
    # a killed prefill engine: the pull fails at once (refused), not after the timeout
    other = prompt(5 * BS + 1, 32)  # not in D's prefix cache
    ref = engines["P1"].generate([other], GREEDY, use_tqdm=False, cache_salt="reference")
    params = prefill(p3, [other])[0].kv_transfer_params
    for child in p3.group.children:
        os.kill(child.proc.pid, signal.SIGKILL)
    p3.shutdown()
    timeouts = d.get_stats()["kv_transfer_timeouts"]
    out = d.generate([other], GREEDY, use_tqdm=False, kv_transfer_params=params)
    assert out[0].token_ids == ref[0].token_ids and out[0].metrics.num_cached_tokens == 0
    stats = d.get_stats()
    assert stats["kv_transfer_failed"] == failed + 1
    assert stats["kv_transfer_timeouts"] == timeouts
    assert settled(d)
