"""Worker side of the KV offload tiers on CPU: offload then restore gives identical bytes
(through the host pool and through the disk tier), the copy order within one step, corrupt /
truncated / misplaced disk records are misses, and host pool shapes of TP shards."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest
import torch

from protocol.codec import unpack
from protocol.kv_transfer import KVTransfers, pack_pairs, pack_tags
from workers.kv_offload.disk import (
    HEADER_BYTES,
    READ_FAILED,
    READ_OK,
    DiskKVStore,
    RecordError,
    decode_record,
    encode_record,
)
from workers.kv_offload.host_pool import (
    HostKVLayout,
    HostKVPool,
    KVOffloadExecutor,
    host_bytes,
    layout_for_config,
)
from workers.model.config import dummy_config

NUM_BLOCKS = 10


def make_caches(layout: HostKVLayout, seed: int = 0) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.block_size, layout.kv_heads, layout.head_dim)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=g).to(layout.dtype)

    return [one() for _ in range(layout.num_caches)], [one() for _ in range(layout.num_caches)]


def block(ks: list[torch.Tensor], vs: list[torch.Tensor], b: int) -> np.ndarray:
    """Every cache's K and V of device block b, as bytes."""
    pairs = zip(ks, vs, strict=True)
    return np.concatenate([host_bytes(torch.stack((k[b], v[b]))) for k, v in pairs])


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def layout(request: pytest.FixtureRequest) -> HostKVLayout:
    return HostKVLayout(num_caches=3, block_size=4, kv_heads=2, head_dim=8, dtype=request.param)


def executor(layout: HostKVLayout, host_blocks: int = 4, disk_dir: str | None = None,
             disk_slots: int = 4) -> KVOffloadExecutor:
    disk = None
    if disk_dir is not None:
        disk = DiskKVStore(disk_dir, rank=0, num_slots=disk_slots, layout=layout.describe(),
                           block_nbytes=layout.nbytes_per_block)
    return KVOffloadExecutor(HostKVPool(layout, host_blocks), disk)


def settle(ex: KVOffloadExecutor) -> tuple[list[int], list[int]]:
    ex.synchronize()
    r = ex.poll_loads()
    return ([], []) if r is None else (unpack(r.done_host_slots), unpack(r.failed_host_slots))


def test_offload_then_restore_is_bit_identical(layout: HostKVLayout) -> None:
    ks, vs = make_caches(layout)
    want = {b: block(ks, vs, b) for b in (3, 5, 8)}
    ex = executor(layout)
    ex.apply(KVTransfers(device_to_host=pack_pairs([(3, 2), (5, 0), (8, 1)])), ks, vs)
    for k, v in zip(ks, vs, strict=True):  # the device blocks are reused for something else
        k[[3, 5, 8]] = 0
        v[[3, 5, 8]] = 0
    ex.apply(KVTransfers(host_to_device=pack_pairs([(2, 6), (0, 3), (1, 9)])), ks, vs)
    ex.wait_before_forward()
    assert np.array_equal(block(ks, vs, 6), want[3])
    assert np.array_equal(block(ks, vs, 3), want[5])
    assert np.array_equal(block(ks, vs, 9), want[8])
    # untouched blocks stay untouched
    fresh = make_caches(layout)
    assert np.array_equal(block(ks, vs, 1), block(*fresh, 1))


def test_evict_and_restore_into_the_same_block_in_one_step(layout: HostKVLayout) -> None:
    # the contract's order: device -> host before host -> device
    ks, vs = make_caches(layout)
    ex = executor(layout)
    ex.apply(KVTransfers(device_to_host=pack_pairs([(4, 0)])), ks, vs)
    old4, old7 = block(ks, vs, 4), block(ks, vs, 7)
    ex.apply(KVTransfers(device_to_host=pack_pairs([(7, 1)]),
                         host_to_device=pack_pairs([(0, 7)])), ks, vs)
    assert np.array_equal(block(ks, vs, 7), old4)
    assert np.array_equal(host_bytes(ex.pool.data[1]), old7)


def test_spill_to_disk_and_promote_back(layout: HostKVLayout, tmp_path: os.PathLike) -> None:
    ks, vs = make_caches(layout)
    want = block(ks, vs, 2)
    ex = executor(layout, host_blocks=2, disk_dir=str(tmp_path))
    ex.apply(KVTransfers(device_to_host=pack_pairs([(2, 0)])), ks, vs)
    # one step: slot 0 spills to disk slot 3 and is refilled from device block 5 (the snapshot
    # is taken before the device copy overwrites the slot)
    ex.apply(KVTransfers(host_to_disk=pack_pairs([(0, 3)]), host_to_disk_tags=pack_tags([77]),
                         device_to_host=pack_pairs([(5, 0)])), ks, vs)
    assert np.array_equal(host_bytes(ex.pool.data[0]), block(ks, vs, 5))
    # read back into slot 1 (no wait for the write: the store orders them per slot)
    ex.apply(KVTransfers(disk_to_host=pack_pairs([(3, 1)]), disk_to_host_tags=pack_tags([77])),
             ks, vs)
    assert settle(ex) == ([1], [])
    ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 9)])), ks, vs)
    assert np.array_equal(block(ks, vs, 9), want)
    ex.close()


def _spilled(layout: HostKVLayout, tmp_path: os.PathLike) -> tuple[KVOffloadExecutor, list]:
    ks, vs = make_caches(layout)
    ex = executor(layout, host_blocks=2, disk_dir=str(tmp_path))
    ex.apply(KVTransfers(device_to_host=pack_pairs([(2, 0)])), ks, vs)
    ex.apply(KVTransfers(host_to_disk=pack_pairs([(0, 1)]), host_to_disk_tags=pack_tags([5])),
             ks, vs)
    ex.synchronize()
    return ex, [ks, vs]


def _corrupt_payload(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[HEADER_BYTES + 3] ^= 0x40
    open(path, "wb").write(bytes(data))


def _truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-1])


def _corrupt_header(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[10] ^= 0x01  # inside the tag
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("damage", [_corrupt_payload, _truncate, _corrupt_header, os.remove],
                         ids=["payload-bitflip", "truncated", "header-bitflip", "missing"])
def test_damaged_record_is_a_miss(layout: HostKVLayout, tmp_path: os.PathLike, damage) -> None:
    ex, (ks, vs) = _spilled(layout, tmp_path)
    assert ex.disk is not None
    damage(str(ex.disk.path(1)))
    ex.apply(KVTransfers(disk_to_host=pack_pairs([(1, 1)]), disk_to_host_tags=pack_tags([5])),
             ks, vs)
    assert settle(ex) == ([], [1])
    # the slot is never handed on as KV: a restore from it is refused
    with pytest.raises(RuntimeError, match="failed"):
        ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 4)])), ks, vs)
    # and it is usable again once the device writes it
    ex.apply(KVTransfers(device_to_host=pack_pairs([(3, 1)])), ks, vs)
    ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 4)])), ks, vs)
    ex.close()


def test_record_of_another_block_or_layout_is_a_miss(layout: HostKVLayout,
                                                     tmp_path: os.PathLike) -> None:
    ex, (ks, vs) = _spilled(layout, tmp_path)
    ex.apply(KVTransfers(disk_to_host=pack_pairs([(1, 1)]), disk_to_host_tags=pack_tags([6])),
             ks, vs)
    assert settle(ex) == ([], [1])
    ex.close()
    other = HostKVLayout(layout.num_caches, layout.block_size, layout.kv_heads,
                         layout.head_dim, torch.float16 if layout.dtype != torch.float16
                         else torch.float32)
    store = DiskKVStore(str(tmp_path), 0, 4, other.describe(), layout.nbytes_per_block)
    dst = np.zeros(layout.nbytes_per_block, np.uint8)
    store.read_into(1, 5, dst, host_slot=0)
    store.wait()
    assert store.poll() == ([], [0]) and not dst.any()
    store.close()


def test_a_read_while_in_flight_is_refused(layout: HostKVLayout, tmp_path: os.PathLike) -> None:
    ex, (ks, vs) = _spilled(layout, tmp_path)
    assert ex.disk is not None
    gate = threading.Event()
    real_read = ex.disk._read

    def slow_read(*args: object) -> bool:
        gate.wait(30)
        return real_read(*args)  # type: ignore[arg-type]

    ex.disk._read = slow_read  # type: ignore[method-assign]
    ex.apply(KVTransfers(disk_to_host=pack_pairs([(1, 1)]), disk_to_host_tags=pack_tags([5])),
             ks, vs)
    assert ex.poll_loads() is None  # still reading: nothing to report, nothing blocked
    with pytest.raises(RuntimeError, match="in flight"):
        ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 4)])), ks, vs)
    with pytest.raises(RuntimeError, match="while it loads"):
        ex.apply(KVTransfers(device_to_host=pack_pairs([(4, 1)])), ks, vs)
    gate.set()
    assert settle(ex) == ([1], [])
    ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 4)])), ks, vs)
    assert np.array_equal(block(ks, vs, 4), block(ks, vs, 2))
    ex.close()


def test_tp_ranks_agree_on_a_read_that_failed_on_one(layout: HostKVLayout,
                                                      tmp_path: os.PathLike) -> None:
    # two ranks, same plan; rank 1's record is damaged: the minimum of the states fails the
    # read on both, so both refuse to restore it
    ranks = []
    for r in range(2):
        ks, vs = make_caches(layout, seed=r)
        disk = DiskKVStore(str(tmp_path), r, 4, layout.describe(), layout.nbytes_per_block)
        ex = KVOffloadExecutor(HostKVPool(layout, 2), disk)
        ex.apply(KVTransfers(device_to_host=pack_pairs([(2, 0)])), ks, vs)
        ex.apply(KVTransfers(host_to_disk=pack_pairs([(0, 1)]),
                             host_to_disk_tags=pack_tags([5])), ks, vs)
        ex.synchronize()
        ranks.append((ex, ks, vs))
    _truncate(str(ranks[1][0].disk.path(1)))  # type: ignore[union-attr]
    for ex, ks, vs in ranks:
        ex.apply(KVTransfers(disk_to_host=pack_pairs([(1, 1)]),
                             disk_to_host_tags=pack_tags([5])), ks, vs)
        ex.synchronize()
    states = [ex.load_states() for ex, _, _ in ranks]
    assert states[0] == ([1], [READ_OK]) and states[1] == ([1], [READ_FAILED])
    agreed = [min(col) for col in zip(*(st for _, st in states), strict=True)]
    for ex, ks, vs in ranks:
        report = ex.settle([1], agreed)
        assert report is not None and unpack(report.failed_host_slots) == [1]
        with pytest.raises(RuntimeError, match="failed"):
            ex.apply(KVTransfers(host_to_device=pack_pairs([(1, 4)])), ks, vs)
        assert ex.load_states() == ([], [])
        ex.close()


def test_record_codec() -> None:
    payload = bytes(range(256)) * 4
    rec = encode_record(9, 3, payload)
    assert bytes(decode_record(rec, 9, 3, len(payload))) == payload
    for bad, args in [(rec[:-1], (9, 3, 1024)), (rec, (8, 3, 1024)), (rec, (9, 4, 1024)),
                      (rec, (9, 3, 1023)), (b"XXXX" + rec[4:], (9, 3, 1024)),
                      (rec[:10], (9, 3, 1024))]:
        with pytest.raises(RecordError):
            decode_record(bad, *args)
    assert DiskKVStore.slots_for(10 * (HEADER_BYTES + 100), 100) == 10


@pytest.mark.parametrize("preset, tp, kv_heads", [("tiny", 1, 4), ("tiny", 2, 2), ("tiny", 4, 1)])
def test_tp_shard_shapes(preset: str, tp: int, kv_heads: int) -> None:
    cfg = dummy_config(f"dummy:{preset}")
    for rank in range(tp):
        lay = layout_for_config(cfg, rank, tp, 16, torch.bfloat16)
        assert lay.block_shape == (cfg.num_hidden_layers, 2, 16, kv_heads, cfg.head_dim)
        full = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * 2
        assert lay.nbytes_per_block * tp == full  # the shards add up to the whole block
        pool = HostKVPool(lay, HostKVPool.blocks_for(10 * lay.nbytes_per_block + 1, lay))
        assert tuple(pool.data.shape) == (10, *lay.block_shape)
        assert pool.data.dtype == torch.bfloat16


def test_padded_kv_heads_shard() -> None:
    # 3 KV heads at TP=2 are padded to 4: each rank holds 2 (the model's own split)
    cfg = dummy_config("dummy:tiny")
    cfg = dataclasses.replace(cfg, num_key_value_heads=3, num_attention_heads=9)
    lay = layout_for_config(cfg, 1, 2, 16, torch.float32)
    assert lay.kv_heads == 2


def test_layout_from_allocated_caches(layout: HostKVLayout) -> None:
    ks, _ = make_caches(layout)
    assert HostKVLayout.from_caches(ks) == layout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_copies_round_trip(layout: HostKVLayout) -> None:
    dev = torch.device("cuda")
    ks, vs = (list(t) for t in make_caches(layout))
    want = {b: block(ks, vs, b) for b in (2, 6)}
    ks, vs = [k.to(dev) for k in ks], [v.to(dev) for v in vs]
    ex = KVOffloadExecutor(HostKVPool(layout, 4, pin=True), device=dev)
    ex.apply(KVTransfers(device_to_host=pack_pairs([(2, 0), (6, 3)])), ks, vs)
    ex.wait_before_forward()
    for k, v in zip(ks, vs, strict=True):  # the forward overwrites the evicted blocks
        k[[2, 6]] = 0
        v[[2, 6]] = 0
    # evict block 9 and restore into it in the same step (device -> host runs first)
    old9 = block([k.cpu() for k in ks], [v.cpu() for v in vs], 9)
    ex.apply(KVTransfers(device_to_host=pack_pairs([(9, 1)]),
                         host_to_device=pack_pairs([(0, 9), (3, 2)])), ks, vs)
    ex.wait_before_forward()
    torch.cuda.current_stream().synchronize()
    cpu_k, cpu_v = [k.cpu() for k in ks], [v.cpu() for v in vs]
    assert np.array_equal(block(cpu_k, cpu_v, 9), want[2])
    assert np.array_equal(block(cpu_k, cpu_v, 2), want[6])
    ex.synchronize()
    assert np.array_equal(host_bytes(ex.pool.data[1]), old9)
