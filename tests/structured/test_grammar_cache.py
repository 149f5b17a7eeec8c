"""The compiled-grammar cache keeps to its byte budget and its compile time limit.

In one process, with real xgrammar and the small test tokenizer: a hostile stream of new
schemas (about 60 KB compiled each) leaves the frontend's memory flat once the cache is full;
a grammar a request holds is never evicted; a compile past the limit is a ValueError naming it,
is cancelled if it never started, and its result is not kept. Slow compiles come from the
``before_compile`` hook held on an Event: no timing decides anything.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from launch.structured import FrontendGrammars
from launch.tokenizer import load_tokenizer
from protocol.config import EngineConfig
from tests.serve.serve_helpers import make_tokenizer_dir
from tests.structured.grammar_helpers import params
from workers.sample.grammar import tokenizer_info
from workers.sample.grammar_cache import GrammarCache


def rss_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(make_tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))


def test_hostile_schemas_leave_memory_flat_and_held_grammars_stay(tokenizer: Any) -> None:
    budget_mb = 16
    grammars = FrontendGrammars(tokenizer, 32000,
                                EngineConfig(structured_outputs_cache_mb=budget_mb))
    cache = grammars.cache
    assert cache is not None
    try:
        held = grammars.submit(params(0))  # a request that holds its grammar throughout
        held.wait()
        rss = []
        for i in range(1, 601):
            grammars.prepare([params(i)])
            assert cache.size_bytes <= budget_mb * 2**20 + 2**17  # + the held one
            rss.append(rss_kb())
        assert cache.evictions > 300  # the budget holds ~270 of them
        # the held grammar outlived 600 newer ones
        again = grammars.submit(params(0))
        assert again.future is held.future  # served from the cache: still there
        again.hold.release()
        # flat once full: the last 200 new schemas grew RSS by under 10% of the budget
        # (unbounded, they would add ~12 MB)
        growth_kb = rss[-1] - rss[-201]
        assert growth_kb < budget_mb * 1024 // 10, (growth_kb, rss[::100])
    finally:
        held.hold.release()
        grammars.close()


def test_a_compile_past_the_limit_fails_alone_and_is_not_kept(tokenizer: Any) -> None:
    go = threading.Event()
    entered = threading.Semaphore(0)
    slow = {"on": True}

    def before_compile() -> None:  # every compile waits while the test says "slow"
        if slow["on"]:
            entered.release()
            go.wait(60)

    grammars = FrontendGrammars(tokenizer, 512,
                                EngineConfig(structured_outputs_compile_timeout=0.2),
                                before_compile=before_compile)
    cache = grammars.cache
    assert cache is not None
    try:
        # the compiler loads first (its own time, not counted): a plain compile
        slow["on"] = False
        grammars.prepare([params(100)])
        slow["on"] = True
        # two compiles take both pool threads and hang; a third queues behind them
        pending = [grammars.submit(params(i)) for i in range(3)]
        assert entered.acquire(timeout=60) and entered.acquire(timeout=60)  # both running
        errors = []
        for p in pending:
            with pytest.raises(ValueError) as e:
                grammars.finish(params(0), p)
            errors.append(str(e.value))
        assert all("did not compile within 0.2 s" in e for e in errors), errors
        assert all("--structured-outputs-compile-timeout" in e for e in errors), errors
        assert "queued" in errors[2] and "queued" not in errors[0], errors
        assert pending[2].future.cancelled()  # never started: nobody wanted it any more
        assert len(cache) == 1  # only the plain one: the given-up compiles are gone
        slow["on"] = False
        go.set()
        for p in pending[:2]:
            p.future.result(timeout=60)  # the running ones finish ...
        assert len(cache) == 1 and cache.size_bytes > 0  # ... and their results are dropped
        assert grammars.prepare([params(0)])  # the same schema compiles again when it can
    finally:
        go.set()
        grammars.close()


def test_worker_cache_keeps_what_the_core_announced_until_it_drops_it(
        tokenizer: Any) -> None:
    cache = GrammarCache(lambda: tokenizer_info(tokenizer, 512))  # no budget: the core's
    try:
        a = params(1).structured_outputs
        b = params(2).structured_outputs
        assert a is not None and b is not None
        cache.submit(a, grammar_id=7).result(timeout=60)
        assert cache.submit(b, keep=False).result(timeout=60)  # not announced: not kept
        assert len(cache) == 1 and cache.size_bytes > 0
        assert cache.submit(a, keep=False).done()  # the announced one is found
        cache.drop([7, 99])  # 99: never seen (a no-op)
        assert len(cache) == 0 and cache.size_bytes == 0
    finally:
        cache.close()


def test_the_compile_pool_does_not_keep_the_process_alive() -> None:
    # a compile that never ends must not hold the interpreter at exit: daemon threads
    from workers.sample.compile_pool import CompilePool

    pool = CompilePool(1, "t")
    never = threading.Event()
    pool.submit(never.wait)
    queued = pool.submit(lambda: None)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-"))
    pool.close()
    assert queued.cancelled()
    never.set()
