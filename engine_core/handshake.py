"""Start-up of the engine core: every rank's hello, the broadcast sync, and the Scheduler built
from what the ranks report (KV blocks, model length, KV cache groups, offload tier sizes)."""

from __future__ import annotations

import logging
import os
import time

from engine_core.kv_offload.scheduling import make_offload_manager
from engine_core.sched.scheduler import Scheduler
from engine_core.worker_link import EngineFatal, WorkerLink
from protocol.codec import Encoder
from protocol.config import EngineConfig, default_max_batched_tokens
from protocol.kv_cache_spec import kv_cache_groups
from protocol.messages import HealthPing, WorkerError, WorkerHello, WorkerReady
from protocol.transport import recv_frame

logger = logging.getLogger("tandem.engine_core")

STARTUP_TIMEOUT_S = float(os.environ.get("TANDEM_STARTUP_TIMEOUT", "600"))


def collect_hellos(link: WorkerLink, encoder: Encoder, world_size: int) -> dict[int, WorkerHello]:
    """Wait for every rank's hello, then make sure every SUB socket receives broadcasts."""
    hellos: dict[int, WorkerHello] = {}
    ready: set[int] = set()
    nonce = -1
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(hellos) < world_size:
        # A rank that said hello is already listening and exits after CORE_SILENCE_S
        # without a message: keep it fed while slower ranks still load. These are sync
        # pings, so their answers also count for the sync below.
        link.pub.send(encoder.encode(HealthPing(nonce)))
        msg = link.recv(deadline)
        if msg is None:
            continue
        if isinstance(msg, WorkerHello):
            if msg.world_size != world_size:
                raise EngineFatal(
                    f"rank {msg.rank} reports WORLD_SIZE={msg.world_size}, "
                    f"the engine expects {world_size}"
                )
            hellos[msg.rank] = msg
        elif isinstance(msg, WorkerReady):
            ready.add(msg.rank)
        elif isinstance(msg, WorkerError):
            raise EngineFatal(link.describe_error(msg))
    # Slow joiners: PUB drops what a not-yet-connected SUB would have got, so publish sync
    # pings until every rank has answered one.
    while len(ready) < world_size:
        link.pub.send(encoder.encode(HealthPing(nonce)))
        frame = recv_frame(link.results, 20)
        if time.monotonic() > deadline:
            raise EngineFatal(f"only ranks {sorted(ready)} answered the start-up sync")
        if frame is None:
            continue
        msg = link.decode(frame)
        if isinstance(msg, WorkerReady):
            ready.add(msg.rank)
        elif isinstance(msg, WorkerError):
            raise EngineFatal(link.describe_error(msg))
    return hellos


def build_scheduler(config: EngineConfig, hellos: dict[int, WorkerHello]) -> Scheduler:
    """The Scheduler over what every rank can hold: the smallest rank bounds the KV blocks,
    the model length and the offload tiers."""
    h0 = hellos[0]
    num_blocks = min(h.num_blocks for h in hellos.values())
    max_model_len = min(h.max_model_len for h in hellos.values())
    budget = config.max_num_batched_tokens or (
        default_max_batched_tokens("cuda" if h0.device.startswith("cuda") else "cpu")
    )
    # the model's KV cache groups, from the per-layer KV spec every rank reports
    windows = {tuple(h.layer_windows) for h in hellos.values()}
    if len(windows) != 1:
        raise EngineFatal(f"ranks report different per-layer KV specs: {sorted(windows)}")
    groups = kv_cache_groups(h0.layer_windows)
    # the KV offload tiers: every rank holds its shard of the same slots, so the smallest
    # rank's tier sizes bound them all
    offload = None
    if config.kv_offload_memory > 0:
        offload = make_offload_manager(
            min(h.num_host_blocks for h in hellos.values()),
            min(h.num_disk_blocks for h in hellos.values()),
            h0.kv_bytes_per_block,
            len(groups),
        )
        if offload is None:
            logger.warning("KV offload tiers off: %d KV cache groups (only models with one "
                           "full-attention group are supported) or no host block fits",
                           len(groups))
    logger.info(
        "engine ready: %d ranks on %s, %d KV blocks of %d tokens, KV cache groups %s",
        len(hellos),
        h0.device,
        num_blocks,
        config.block_size,
        [(g.kind, g.sliding_window, len(g.layer_ids)) for g in groups],
    )
    return Scheduler(
        config,
        num_blocks,
        max_model_len,
        budget,
        eos_token_id=h0.eos_token_id,
        kv_cache_groups=groups,
        offload=offload,
        images=h0.accepts_images,
    )
