"""The adapter registry: content hashes, PrepareLoRA once per adapter, requests held until every
rank answered, refusals (missing file, id/name conflicts, a rank's error), unload rules."""

from __future__ import annotations

import hashlib
import os
import select
from pathlib import Path

import msgspec
import pytest

from engine_core.lora.registry import LoRARegistry
from engine_core.lora.slots import LoRASlots
from engine_core.request import Request
from protocol.lora import LoRARequest
from protocol.messages import DropLoRA, LoRAReady, LoRAResult, PrepareLoRA, SamplingParams
from protocol.request_options import RequestOptions


def adapter_dir(root: Path, name: str, weights: bytes = b"weights") -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "adapter_config.json").write_bytes(b'{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


def request(rid: str, lora: LoRARequest | None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), None, 0.0,
                   RequestOptions(lora=lora))


class Bench:
    """A registry over ``world`` ranks; what it broadcasts is kept in ``sent``."""

    def __init__(self, world: int = 2) -> None:
        self.sent: list[msgspec.Struct] = []
        self.reg = LoRARegistry(world, self.sent.append)

    def hashed(self) -> tuple[list[Request], list]:
        """Wait (up to 10 s) for the hashing thread, then settle."""
        go, failed = [], []
        for _ in range(100):
            if not self.reg._hashing:
                break
            select.select([self.reg.wakeup_fd], [], [], 0.1)
            ok, bad = self.reg.settle([])
            go += ok
            failed += bad
        assert not self.reg._hashing, "the content hash never finished"
        return go, failed

    def prepared(self) -> list[PrepareLoRA]:
        return [m for m in self.sent if isinstance(m, PrepareLoRA)]


@pytest.fixture
def bench() -> Bench:
    b = Bench()
    yield b
    b.reg.close()


def test_held_until_every_rank_is_ready_then_let_on(bench: Bench, tmp_path: Path) -> None:
    path = adapter_dir(tmp_path, "sql", b"\x00" * 3_000_000)
    lora = LoRARequest("sql", 3, path)
    r1, r2 = request("r1", lora), request("r2", lora)
    assert bench.reg.route(r1) is None and bench.reg.route(r2) is None
    bench.reg.load(lora)
    assert bench.reg.busy and bench.reg.num_held == 2
    bench.hashed()
    want = hashlib.sha256(b'{"r": 8}' + b"\x00" * 3_000_000).hexdigest()
    assert bench.prepared() == [PrepareLoRA(lora, want)]  # once, for two requests and a load
    assert bench.reg.settle([LoRAReady(rank=1, lora_int_id=3)]) == ([], [])
    assert not bench.reg.take_results()
    go, failed = bench.reg.settle([LoRAReady(rank=0, lora_int_id=3)])
    assert go == [r1, r2] and not failed
    assert r1.lora_hash == r2.lora_hash == want
    assert bench.reg.take_results() == [LoRAResult(lora_name="sql")]
    # ready now: a new request goes straight on, nothing more is broadcast
    r3 = request("r3", lora)
    assert bench.reg.route(r3) is r3 and r3.lora_hash == want
    assert len(bench.sent) == 1 and not bench.reg.busy


def test_refusals_name_the_problem(bench: Bench, tmp_path: Path) -> None:
    path = adapter_dir(tmp_path, "sql")
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    err = bench.reg.route(request("r", LoRARequest("sql", 1, path)))
    assert isinstance(err, str) and "adapter_model.safetensors not found" in err
    assert path not in err and not bench.sent and len(bench.reg) == 0  # no paths to clients
    good = adapter_dir(tmp_path, "good")
    assert bench.reg.route(request("a", LoRARequest("good", 2, good))) is None
    other = adapter_dir(tmp_path, "other")
    err = bench.reg.route(request("b", LoRARequest("good", 2, other)))
    assert isinstance(err, str) and "LoRA id 2 is registered" in err
    err = bench.reg.route(request("c", LoRARequest("elsewhere", 2, good)))
    assert isinstance(err, str) and "LoRA id 2 is registered" in err
    err = bench.reg.route(request("d", LoRARequest("good", 7, good)))
    assert isinstance(err, str) and "registered with lora_int_id 2" in err
    for bad, field in [(LoRARequest("x", 0, good), "lora_int_id"),
                       (LoRARequest("x", 2**31, good), "lora_int_id"),
                       (LoRARequest("", 9, good), "lora_name"),
                       (LoRARequest("x", 9, ""), "lora_path")]:
        err = bench.reg.route(request("e", bad))
        assert isinstance(err, str) and field in err
    bench.reg.load(LoRARequest("good", 2, other))
    (res,) = bench.reg.take_results()
    assert "LoRA id 2 is registered" in res.error


def test_a_rank_error_fails_the_held_requests_and_the_load(bench: Bench, tmp_path: Path) -> None:
    path = adapter_dir(tmp_path, "bad")
    lora = LoRARequest("bad", 4, path)
    assert bench.reg.route(request("r", lora)) is None
    bench.reg.load(lora)
    bench.hashed()
    go, failed = bench.reg.settle(
        [LoRAReady(rank=1, lora_int_id=4, error="adapter_config.json: use_dora is not supported")]
    )
    assert not go and [o.request_id for o in failed] == ["r"]
    assert failed[0].finish_reason == "error" and "use_dora" in (failed[0].error or "")
    assert "rank 1" in (failed[0].error or "")
    (res,) = bench.reg.take_results()
    assert "use_dora" in res.error and not res.in_use
    assert bench.sent[-1] == DropLoRA(4)  # ranks that accepted it forget it
    assert len(bench.reg) == 0
    # registered again (the directory was fixed): rank 0's late answer to the first
    # PrepareLoRA must not count for the second one
    assert bench.reg.route(request("r2", lora)) is None
    bench.hashed()
    assert len(bench.prepared()) == 2
    assert bench.reg.settle([LoRAReady(rank=0, lora_int_id=4)]) == ([], [])  # stale
    assert bench.reg.settle([LoRAReady(rank=1, lora_int_id=4)]) == ([], [])
    go, _ = bench.reg.settle([LoRAReady(rank=0, lora_int_id=4)])
    assert [r.request_id for r in go] == ["r2"]


def test_abort_drops_a_held_request(bench: Bench, tmp_path: Path) -> None:
    lora = LoRARequest("a", 1, adapter_dir(tmp_path, "a"))
    assert bench.reg.route(request("r", lora)) is None
    (out,) = bench.reg.abort(["r", "unknown"])
    assert out.finish_reason == "abort" and "r" not in bench.reg
    bench.hashed()
    go, _ = bench.reg.settle([LoRAReady(rank=0, lora_int_id=1), LoRAReady(rank=1, lora_int_id=1)])
    assert go == []


def test_unload_rules(bench: Bench, tmp_path: Path) -> None:
    lora = LoRARequest("a", 1, adapter_dir(tmp_path, "a"))
    slots = LoRASlots(2)
    assert bench.reg.unload("nope", [], slots).not_found
    assert bench.reg.route(request("held", lora)) is None
    res = bench.reg.unload("a", [], slots)
    assert res.in_use and "still being loaded" in res.error
    bench.hashed()
    (running,) = bench.reg.settle(
        [LoRAReady(rank=0, lora_int_id=1), LoRAReady(rank=1, lora_int_id=1)])[0]
    res = bench.reg.unload("a", [running], slots)
    assert res.in_use and "in use by 1 request" in res.error
    # in a slot, used by nobody: the slot is emptied in the next step, DropLoRA after it
    slots.acquire(running)
    slots.release(running)
    slots.take_ops()
    n = len(bench.sent)
    assert bench.reg.unload("a", [], slots) == LoRAResult(lora_name="a")
    assert len(bench.sent) == n and [(o.slot, o.lora_int_id) for o in slots.ops] == [(0, 0)]
    err = bench.reg.route(request("again", lora))
    assert isinstance(err, str) and "still being unloaded" in err
    bench.reg.after_publish()
    assert bench.sent[-1] == DropLoRA(1)
    assert bench.reg.unload("a", [], slots).not_found
    # in no slot: DropLoRA at once
    b = LoRARequest("b", 2, adapter_dir(tmp_path, "b"))
    bench.reg.load(b)
    bench.hashed()
    bench.reg.settle([LoRAReady(rank=0, lora_int_id=2), LoRAReady(rank=1, lora_int_id=2)])
    assert bench.reg.unload("b", [], slots) == LoRAResult(lora_name="b")
    assert bench.sent[-1] == DropLoRA(2)
