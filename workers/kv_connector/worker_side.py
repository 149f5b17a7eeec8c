"""The KV connector's worker side (vLLM's names): one per rank, next to the model runner.

- ``register_kv_caches``: after the KV cache is allocated. A prefill rank (kv_producer or
  kv_both) starts its block server; on CPU with the shared-memory path possible, it first
  moves its caches into a memfd so same-host decode ranks can copy from them directly. With
  NIXL installed it registers the caches with a NIXL agent. A decode rank (kv_consumer or
  kv_both) gets a puller.
- ``start_load_kv``: the step diff's connector ops, before the forward: leases to serve or
  stop serving, loads to start or cancel. Loads run on the puller's thread; nothing here waits.
- ``wait_for_save``: nothing to wait for in this pull design: a prefill rank's KV stays in its
  own blocks, which the engine core holds under a lease until the decode side is done.
- ``get_finished``: each rank reports its settled loads itself (KVConnectorReport on its own
  socket, as each load settles); the engine core acts on a load once every rank has.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
import zmq

from protocol.codec import unpack
from protocol.kv_connector import KVConnectorMetadata, KVTransferConfig, check_ops
from protocol.kv_peer import PeerInfo
from workers.kv_connector.block_server import BlockServer
from workers.kv_connector.peer import tcp_addr
from workers.kv_connector.puller import LocalLayout, Puller, boot_id

logger = logging.getLogger("tandem.kv_connector")


class KVConnectorWorker:
    def __init__(self, cfg: KVTransferConfig, rank: int, tp_size: int,
                 secret: bytes | None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.tp_size = tp_size
        self.secret = secret
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.server: BlockServer | None = None
        self.puller: Puller | None = None
        self.shared: Any = None  # SharedCaches of a prefill rank on CPU
        self.nixl: Any = None  # NixlAgent of a prefill rank

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    def register_kv_caches(self, model: Any) -> None:
        caches = [t for pair in model.kv_caches for t in pair]
        connector = self.cfg.connector
        cpu = caches[0].device.type == "cpu"
        if self.cfg.is_producer and cpu and connector in ("auto", "shm"):
            from workers.kv_connector.shm import SharedCaches, rebind_model_caches

            self.shared = SharedCaches(caches)
            rebind_model_caches(model, self.shared.tensors)
            caches = self.shared.tensors
        lay = model.layout
        if self.cfg.is_producer:
            self._start_server(model, caches, lay.kv_heads)
        if self.cfg.is_consumer:
            layout = LocalLayout(self.rank, len(caches), caches[0].shape[1], lay.kv_heads,
                                 model.cfg.num_key_value_heads, caches[0].shape[3],
                                 str(caches[0].dtype).removeprefix("torch."))
            self.puller = Puller(self.ctx, connector, self.secret, layout, caches)

    def _start_server(self, model: Any, caches: list[torch.Tensor], kv_heads: int) -> None:
        nixl_meta, addrs = b"", []
        if self.cfg.connector in ("auto", "nixl"):
            from workers.kv_connector.nixl import NixlAgent, nixl_available

            if nixl_available():
                self.nixl = NixlAgent(f"tandem-p-{os.getpid()}-{self.rank}", caches)
                nixl_meta, addrs = self.nixl.metadata, [c.data_ptr() for c in caches]
            elif self.cfg.connector == "nixl":
                raise RuntimeError("kv_connector nixl: NIXL is not installed "
                                   "(pip install nixl-cu12)")
        c0 = caches[0]
        info = PeerInfo(
            engine_id=self.cfg.engine_id, rank=self.rank, tp_size=self.tp_size,
            hostname=socket.gethostname(), boot_id=boot_id(), pid=os.getpid(),
            device=str(c0.device), dtype=str(c0.dtype).removeprefix("torch."),
            num_caches=len(caches), num_blocks=c0.shape[0], block_size=c0.shape[1],
            kv_heads=kv_heads, total_kv_heads=model.cfg.num_key_value_heads,
            head_dim=c0.shape[3], shm_fd=self.shared.fd if self.shared is not None else -1,
            nixl_metadata=nixl_meta, cache_addrs=addrs)
        port = self.cfg.kv_port + 1 + self.rank if self.cfg.kv_port else "*"
        self.server = BlockServer(self.ctx, tcp_addr(self.cfg.kv_ip, port),  # type: ignore[arg-type]
                                  self.secret, caches, info,
                                  self.nixl.progress if self.nixl is not None else None)
        self.server.start()

    def connect_reports(self, results_addr: str) -> None:
        """The engine core's results endpoint is known (the rank said hello): the puller
        reports there."""
        if self.puller is not None:
            self.puller.start(results_addr)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        check_ops(meta)
        if self.server is not None:
            for e in meta.expose:
                self.server.expose(e.key, unpack(e.block_ids))
            for key in meta.unexpose:
                self.server.unexpose(key)
        elif meta.expose:
            raise RuntimeError("a KV lease to serve on a rank that is not a producer")
        if self.puller is not None:
            if meta.cancel:
                self.puller.cancel(unpack(meta.cancel))
            for op in meta.loads:
                self.puller.submit(op)
        elif meta.loads:
            raise RuntimeError("a KV load on a rank that is not a consumer")

    def wait_for_save(self) -> None:
        """Nothing to wait for: see the module docstring."""

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()
        if self.server is not None:
            self.server.close()
        if self.nixl is not None:
            self.nixl.close()
