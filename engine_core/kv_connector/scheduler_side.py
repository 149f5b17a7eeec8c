"""The KV connector's scheduler side (vLLM's names): which prompt tokens come from a prefill
engine, the loads the ranks run, the leases a prefill engine holds, and what a finished
request leaves behind.

Decode side (a request with ``do_remote_prefill``):

1. ``get_num_new_matched_tokens`` at admission: the prompt tokens after the local prefix hit,
   except the last one (recomputed here, so the first token is sampled on this side), load
   asynchronously;
2. the scheduler allocates their blocks (kept out of the prefix cache until they are complete)
   and calls ``update_state_after_alloc``: the request is set aside (WAITING_FOR_REMOTE_KVS),
   out of the waiting queue, so it blocks nobody; the load goes to the ranks in the next
   step's ``build_connector_meta``;
3. every rank reports (``on_report``); once all have, the request goes back to the front of
   the waiting queue with the loaded tokens computed (``take_ready``), or the failure policy
   applies (recompute from scratch, or finish with an error: ``take_failed``).

Prefill side (a request with ``do_remote_decode``): ``request_finished`` keeps its blocks
under a lease and gives the request's last output the ``kv_transfer_params`` that name them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.kv_connector.leases import LeaseTable, held_key
from engine_core.kv_connector.loads import Address, PendingLoad, RemoteLeases
from engine_core.kv_connector.stats import ConnectorStats
from engine_core.request import Request, RequestStatus
from protocol.codec import pack, unpack
from protocol.kv_connector import (
    KVConnectorMetadata,
    KVConnectorReport,
    KVLeaseControl,
    KVLoadOp,
    KVTransferConfig,
    KVTransferParams,
    params_error,
)

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.kv_cache.single_type_manager import TableKey
    from protocol.messages import EngineCoreOutput

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_HANDED_OVER = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class KVConnectorScheduler:
    def __init__(
        self,
        cfg: KVTransferConfig,
        kvm: KVCacheManager,
        *,
        engine_id: str,
        host: str,
        port: int,
        rank_ports: list[int],
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.kvm = kvm
        self.block_size = kvm.block_size
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.rank_ports = rank_ports
        self.world_size = world_size
        self.clock = clock
        self.stats = ConnectorStats()
        self.leases = LeaseTable(kvm, cfg.kv_lease_s, self.stats, clock)
        self.remote = RemoteLeases(cfg.kv_lease_s, clock)
        self.loads: dict[int, PendingLoad] = {}
        self.loading: dict[str, int] = {}  # request id -> its load in flight
        self.aside: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self._next_load = 0
        self._new_loads: list[KVLoadOp] = []
        self._cancel: list[int] = []
        self._ready: list[Request] = []
        self._failed: list[Request] = []
        self._params_out: dict[str, KVTransferParams] = {}
        # this step's load events, for the scheduler trace
        self.events: dict[str, int] = {"started": 0, "done": 0, "failed": 0}

    # ------------------------------------------------------------------ arrival

    def on_add(self, req: Request) -> str | None:
        """Why the request is refused, or None; a decode request's lease is kept alive from
        now on."""
        # (held tables are keyed by tuples, so no request id can name one)
        p = req.kv_transfer_params
        if p is None:
            return None
        if p.do_remote_decode and not self.cfg.is_producer:
            return (f"kv_transfer_params: do_remote_decode on an engine whose kv_role is "
                    f"{self.cfg.kv_role}")
        if p.do_remote_prefill:
            if not self.cfg.is_consumer:
                return (f"kv_transfer_params: do_remote_prefill on an engine whose kv_role is "
                        f"{self.cfg.kv_role}")
            err = params_error(p, self.block_size, req.num_prompt_tokens)
            if err is not None:
                return err
            self.remote.hold(req.request_id, p)
        return None

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """(prompt tokens after ``num_computed_tokens`` whose KV the remote engine has, whether
        they load asynchronously). The last prompt token is never loaded: it is recomputed,
        so the decode side samples the first token."""
        p = req.kv_transfer_params
        if p is None or not p.do_remote_prefill:
            return 0, False
        n = min(req.num_prompt_tokens, p.remote_num_tokens) - 1 - num_computed_tokens
        if n <= 0:  # a local prefix hit covers it: the remote lease is not needed
            self._consumed(req)
            return 0, False
        return n, True

    def update_state_after_alloc(self, req: Request, num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks for the external tokens are allocated: set the request aside and plan
        its load for the next step."""
        p = req.kv_transfer_params
        assert p is not None and num_external_tokens > 0
        bs = self.block_size
        first = num_computed_tokens // bs
        last = -(-(num_computed_tokens + num_external_tokens) // bs)
        local = self.kvm.get_block_ids(req)[first:last]
        remote = p.remote_block_ids[first:last]
        load_id = self._next_load
        self._next_load += 1
        now = self.clock()
        self.loads[load_id] = PendingLoad(load_id, req, num_computed_tokens, num_external_tokens,
                                          now + self.cfg.kv_transfer_timeout_s, now)
        self.loading[req.request_id] = load_id
        self.aside[req.request_id] = req
        req.status = WAITING_FOR_REMOTE_KVS
        self._new_loads.append(KVLoadOp(
            load_id=load_id, block_ids=pack(local), remote_block_ids=pack(remote),
            remote_key=p.remote_request_id, remote_engine_id=p.remote_engine_id,
            remote_host=p.remote_host, remote_rank_ports=list(p.remote_rank_ports)))
        self.events["started"] += 1

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's operations for the ranks, once; None when there are none."""
        if not (self._new_loads or self._cancel or self.leases.expose or self.leases.unexpose):
            return None
        meta = KVConnectorMetadata(loads=self._new_loads, cancel=pack(self._cancel),
                                   expose=self.leases.expose, unexpose=self.leases.unexpose)
        self._new_loads, self._cancel = [], []
        self.leases.expose, self.leases.unexpose = [], []
        return meta

    def has_ops(self) -> bool:
        """Operations wait for a step (the core publishes one even with nothing to run)."""
        return bool(self._new_loads or self._cancel or self.leases.expose
                    or self.leases.unexpose or self._ready or self._failed)

    def is_waiting(self) -> bool:
        """Something only time, a rank or another engine settles is pending."""
        return bool(self.loads or self.leases.leases or self.remote.refs)

    # ------------------------------------------------------------------ finish

    def request_finished(self, req: Request, status: RequestStatus
                         ) -> tuple[bool, KVTransferParams | None]:
        """Before the scheduler frees ``req``'s blocks: (whether the connector keeps them,
        the kv_transfer_params of its last output)."""
        rid = req.request_id
        self.remote.release(rid)  # a decode request's remote lease: no longer needed
        self.aside.pop(rid, None)
        load_id = self.loading.pop(rid, None)
        if load_id is not None:  # aborted while its KV arrives: the ranks may still write
            load = self.loads[load_id]
            load.request = None
            load.held_key = held_key("load", str(load_id))
            self.kvm.rekey(rid, load.held_key)
            self._give_up(load)
            return True, None
        p = req.kv_transfer_params
        if p is None or not p.do_remote_decode or status not in _HANDED_OVER:
            return False, None
        blocks = self.kvm.get_block_ids(req)[: -(-req.num_prompt_tokens // self.block_size)]
        if not blocks:
            return False, None
        key = self.leases.grant(rid, blocks)
        if key is None:
            return False, None
        out = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_block_ids=blocks,
            remote_host=self.host, remote_port=self.port, remote_rank_ports=self.rank_ports,
            tp_size=len(self.rank_ports), remote_request_id=key,
            remote_num_tokens=req.num_prompt_tokens, remote_lease_s=self.cfg.kv_lease_s)
        self._params_out[rid] = out
        return True, out

    def attach_params(self, outputs: list[EngineCoreOutput]) -> None:
        """Give finished prefill requests' last outputs their kv_transfer_params."""
        if not self._params_out:
            return
        for o in outputs:
            if o.finish_reason is not None:
                p = self._params_out.pop(o.request_id, None)
                if p is not None:
                    o.kv_transfer_params = p

    # ------------------------------------------------------------------ reports and time

    def on_report(self, rep: KVConnectorReport) -> None:
        """One rank's settled loads; late or duplicate reports are ignored."""
        if not 0 <= rep.rank < self.world_size:
            return
        done, failed = unpack(rep.done), unpack(rep.failed)
        for i, load_id in enumerate(done):
            load = self.loads.get(load_id)
            if load is not None and rep.rank not in load.failed:
                load.done.add(rep.rank)
                if i < len(rep.seconds):
                    load.seconds = max(load.seconds, rep.seconds[i])
        if done and rep.nbytes:
            share = rep.nbytes // len(done)
            for load_id in done:
                if load_id in self.loads:
                    self.loads[load_id].nbytes += share
        for i, load_id in enumerate(failed):
            load = self.loads.get(load_id)
            if load is not None:
                load.done.discard(rep.rank)
                load.failed[rep.rank] = rep.reasons[i] if i < len(rep.reasons) else "failed"
        for load_id in unpack(rep.refused):
            load = self.loads.get(load_id)
            if load is not None and rep.rank in load.failed:
                load.refused = True
        for load_id in {*done, *failed}:
            load = self.loads.get(load_id)
            if load is not None and len(load.done) + len(load.failed) >= self.world_size:
                self._settle(load)

    def on_control(self, msg: KVLeaseControl) -> None:
        if msg.engine_id != self.engine_id:
            return  # meant for an engine that used to listen here
        self.leases.renew(msg.renew)
        self.leases.release(msg.release)

    def tick(self) -> None:
        """Give up loads past their deadline, end leases past theirs."""
        now = self.clock()
        for load in self.loads.values():
            if not load.cancelled and now >= load.deadline:
                load.timed_out = True
                self._give_up(load)
        self.leases.expire()

    def take_control(self) -> list[tuple[Address, KVLeaseControl]]:
        return self.remote.take_messages()

    def take_ready(self) -> list[Request]:
        """Requests whose load settled, to go back to the front of the waiting queue."""
        out, self._ready = self._ready, []
        return out

    def take_failed(self) -> list[Request]:
        """Requests whose load failed under the "fail" policy, to finish with an error."""
        out, self._failed = self._failed, []
        return out

    # ------------------------------------------------------------------ internals

    def _give_up(self, load: PendingLoad) -> None:
        if not load.cancelled:
            load.cancelled = True
            self._cancel.append(load.load_id)

    def _consumed(self, req: Request) -> None:
        """The request needs nothing more of the remote engine: free its lease there."""
        self.remote.release(req.request_id)
        req.kv_transfer_params = None

    def _settle(self, load: PendingLoad) -> None:
        del self.loads[load.load_id]
        ok = not load.failed and not load.cancelled
        if ok:
            self.stats.on_transfer(load.seconds, load.nbytes, load.num_tokens)
        else:
            self.stats.failed += 1
            self.stats.timeouts += load.timed_out
            self.stats.lease_refused += load.refused
        self.events["done" if ok else "failed"] += 1
        req = load.request
        if req is None:  # aborted meanwhile: nobody waits, the blocks go back
            assert load.held_key is not None
            self.kvm.free_table(load.held_key)
            return
        del self.loading[req.request_id]
        del self.aside[req.request_id]
        self._consumed(req)
        req.status = RequestStatus.WAITING
        if ok:  # admission takes these tokens as computed (the blocks are the request's)
            req.num_external_computed_tokens = load.num_computed + load.num_tokens
            self._ready.append(req)
            return
        # the blocks hold partial KV, never registered in the prefix cache: drop them
        self.kvm.free(req)
        why = "timed out" if load.timed_out else "; ".join(
            f"rank {r}: {m}" for r, m in sorted(load.failed.items())) or "given up"
        if self.cfg.kv_load_failure_policy == "recompute":
            self._ready.append(req)
        else:
            req.error = f"loading the prompt's KV from the prefill engine failed ({why})"
            self._failed.append(req)

    def exempt_ids(self) -> set[TableKey]:
        """Block tables held outside the running set (for the invariant checks)."""
        held: set[TableKey] = set(self.leases.held_keys())
        held |= {ld.held_key for ld in self.loads.values() if ld.held_key is not None}
        return held | set(self.aside)

    def trace_record(self) -> dict[str, int]:
        """For the scheduler trace, once per step: requests waiting for their KV, loads in
        flight and leases held after this step's decisions, and the loads started, done and
        failed since the last step."""
        rec = {"waiting_for_remote_kvs": len(self.aside), "loads_in_flight": len(self.loads),
               "leases": len(self.leases), **self.events}
        self.events = dict.fromkeys(self.events, 0)
        return rec

    def close(self) -> None:
        self.leases.release_all()

    def stats_dict(self) -> dict[str, float]:
        return self.stats.as_dict(len(self.aside), len(self.loads), len(self.leases))
