"""Wire form of disaggregated prefill and decode (P/D): one engine computes a prompt's KV, another
pulls it and generates.

Three kinds of message, none of which ever carries KV bytes through an engine core:

- ``KVTransferConfig``: the engine option (``--kv-transfer-config``, vLLM's JSON keys);
- ``KVTransferParams``: what a request carries in and its last output carries out
  (``kv_transfer_params`` in vLLM's HTTP bodies): a prefill request asks for
  ``do_remote_decode``; its answer tells the decode engine where the blocks are
  (``do_remote_prefill`` with the prefill engine's id, block ids, host and ports);
- the connector's part of the step diff (``KVConnectorMetadata``: loads to start, loads to give
  up, blocks to serve and to stop serving), the ranks' reports back (``KVConnectorReport``)
  and the lease messages one engine core sends another (``KVLeaseControl``).

The KV itself goes worker to worker (workers/kv_connector/, messages in protocol/kv_peer.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from protocol.config_forms import config_from
from protocol.packing import ProtocolError, unpack

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
# transports; "auto" picks per peer at its first transfer (shared memory on one host on CPU,
# else NIXL when it imports, else the TCP pull); vLLM's connector names are accepted
KV_CONNECTORS = ("auto", "nixl", "tcp", "shm")
_CONNECTOR_ALIASES = {"NixlConnector": "nixl", "TcpConnector": "tcp", "ShmConnector": "shm"}
FAILURE_POLICIES = ("recompute", "fail")


class KVTransferConfig(msgspec.Struct, kw_only=True):
    """``--kv-transfer-config '{"kv_role": "kv_both"}'``; unknown vLLM keys are ignored."""

    kv_role: str = "kv_both"
    kv_connector: str = "auto"
    # a decode engine whose load failed: compute the prompt itself, or end the request with
    # an error
    kv_load_failure_policy: str = "recompute"
    # where this engine's transfer ports listen (and what its answers advertise); a
    # non-loopback address needs TANDEM_SECRET (CURVE), as multi-node does
    kv_ip: str = "127.0.0.1"
    # the engine core's lease port; rank r serves blocks on kv_port + 1 + r. 0 = free ports
    kv_port: int = 0
    engine_id: str = ""  # "" = a random id at start-up
    # a prefill engine holds a finished prompt's blocks this long unless the decode engine
    # renews the lease (it does while the request waits there) or says it is done
    kv_lease_s: float = 30.0
    # a decode engine gives a transfer up after this long (below the lease, so blocks are
    # never read after the prefill engine may have reused them)
    kv_transfer_timeout_s: float = 20.0

    @property
    def connector(self) -> str:
        return _CONNECTOR_ALIASES.get(self.kv_connector, self.kv_connector)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")


def kv_transfer_config_error(c: KVTransferConfig) -> str | None:
    if c.kv_role not in KV_ROLES:
        return f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {c.kv_role!r}"
    if c.connector not in KV_CONNECTORS:
        return (f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)} "
                f"(or NixlConnector), got {c.kv_connector!r}")
    if c.kv_load_failure_policy not in FAILURE_POLICIES:
        return ("kv_transfer_config.kv_load_failure_policy must be recompute or fail, got "
                f"{c.kv_load_failure_policy!r}")
    if not 0 <= c.kv_port <= 65535 - 64:
        return f"kv_transfer_config.kv_port must be in [0, 65471], got {c.kv_port}"
    if not c.kv_lease_s > 0 or not c.kv_transfer_timeout_s > 0:
        return "kv_transfer_config.kv_lease_s and kv_transfer_timeout_s must be > 0 seconds"
    if c.kv_transfer_timeout_s >= c.kv_lease_s:
        return (f"kv_transfer_config.kv_transfer_timeout_s ({c.kv_transfer_timeout_s}) must be "
                f"below kv_lease_s ({c.kv_lease_s})")
    if not c.kv_ip:
        return "kv_transfer_config.kv_ip is empty"
    return None


def with_engine_id(c: KVTransferConfig) -> KVTransferConfig:
    """The config with an engine id: the launcher draws one, so the engine core and every
    rank name the engine alike (a decode rank checks it when it connects)."""
    if c.engine_id:
        return c
    import uuid

    return msgspec.structs.replace(c, engine_id=uuid.uuid4().hex)


def parse_kv_transfer_config(value: str | dict[str, Any] | KVTransferConfig,
                             name: str = "--kv-transfer-config") -> KVTransferConfig:
    """The config in any of its forms (the flag's JSON string, vLLM's dict, the struct);
    ValueError naming the bad key."""
    return config_from(value, KVTransferConfig, name, kv_transfer_config_error)


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's ``kv_transfer_params`` (a map on the wire: it only travels with P/D requests).

    In a prefill request: ``do_remote_decode``. In its answer (and the decode request):
    ``do_remote_prefill`` and where the KV is. ``remote_request_id`` names the blocks' lease
    on the prefill engine (unique there, even when a client reuses request ids);
    ``remote_rank_ports`` are the prefill ranks' block servers (rank r's port, on
    ``remote_host``); ``remote_num_tokens`` the prompt length the blocks hold.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str = ""
    remote_block_ids: list[int] = []
    remote_host: str = ""
    remote_port: int = 0
    remote_rank_ports: list[int] = []
    tp_size: int = 0
    remote_request_id: str = ""
    remote_num_tokens: int = 0
    remote_lease_s: float = 0.0


# bounds on kv_transfer_params, which come from clients: every list and string an engine keeps
# or sends on is bounded, every port a port
MAX_PARAM_CHARS = 256  # remote_engine_id, remote_request_id
MAX_HOST_CHARS = 253  # a DNS name's limit; IPv4 and IPv6 literals are shorter
MAX_REMOTE_TP = 64
MAX_BLOCK_ID = (1 << 31) - 1
# remote_block_ids without a model length to bound them (the HTTP server passes its own bound:
# the blocks of max_model_len tokens; the engine core: the prompt's)
MAX_REMOTE_BLOCKS = 1 << 20
# a host name or an IP literal (IPv6 with or without brackets, a zone after %)
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.%A-Za-z_-]+\]|[0-9A-Za-z.:%_-]+)$")


def params_field_error(p: KVTransferParams, max_blocks: int = MAX_REMOTE_BLOCKS
                       ) -> tuple[str, str] | None:
    """(field, why) for a value out of bounds whatever the engine (types are msgspec's), or
    None. The HTTP server answers 400 naming the field; the engine core refuses the request."""
    def bad(name: str, why: str) -> tuple[str, str]:
        return f"kv_transfer_params.{name}", f"kv_transfer_params.{name} {why}"

    for name in ("remote_engine_id", "remote_request_id"):
        if len(getattr(p, name)) > MAX_PARAM_CHARS:
            return bad(name, f"is longer than {MAX_PARAM_CHARS} characters")
    if len(p.remote_host) > MAX_HOST_CHARS:
        return bad("remote_host", f"is longer than {MAX_HOST_CHARS} characters")
    if p.remote_host and not _HOST.match(p.remote_host):
        return bad("remote_host", "must be a host name or an IP address")
    if not 0 <= p.remote_port <= 65535:
        return bad("remote_port", "must be in [1, 65535]")
    if len(p.remote_rank_ports) > MAX_REMOTE_TP or not 0 <= p.tp_size <= MAX_REMOTE_TP:
        return bad("remote_rank_ports", f"names more than {MAX_REMOTE_TP} ranks")
    if not all(0 < x <= 65535 for x in p.remote_rank_ports):
        return bad("remote_rank_ports", "must be ports in [1, 65535]")
    if len(p.remote_block_ids) > max_blocks:
        return bad("remote_block_ids", f"has more than {max_blocks} blocks (more than a "
                                       "request can hold)")
    if not all(0 < b <= MAX_BLOCK_ID for b in p.remote_block_ids):
        return bad("remote_block_ids", f"must be block ids in [1, {MAX_BLOCK_ID}]")
    if not 0 <= p.remote_num_tokens <= MAX_BLOCK_ID:
        return bad("remote_num_tokens", "must be a token count >= 0")
    if not math.isfinite(p.remote_lease_s) or p.remote_lease_s < 0:
        return bad("remote_lease_s", "must be a finite number of seconds >= 0")
    return None


def params_error(p: KVTransferParams, block_size: int, num_prompt_tokens: int) -> str | None:
    """Why a decode request's params cannot name a load, or None (prefill params: None)."""
    if not p.do_remote_prefill:
        return None
    need = -(-p.remote_num_tokens // block_size)
    bounded = params_field_error(p, max(need, 1))
    if bounded is not None:
        return bounded[1]
    if p.do_remote_decode:
        return "kv_transfer_params: do_remote_prefill and do_remote_decode are both set"
    if not p.remote_engine_id or not p.remote_host or not p.remote_request_id:
        return ("kv_transfer_params: do_remote_prefill needs remote_engine_id, remote_host and "
                "remote_request_id")
    if p.tp_size < 1 or len(p.remote_rank_ports) != p.tp_size:
        return (f"kv_transfer_params: tp_size {p.tp_size} does not match "
                f"{len(p.remote_rank_ports)} remote_rank_ports")
    if not 0 < p.remote_port <= 65535 or not all(0 < x <= 65535 for x in p.remote_rank_ports):
        return "kv_transfer_params: remote ports must be in [1, 65535]"
    if any(b <= 0 for b in p.remote_block_ids):
        return "kv_transfer_params: remote_block_ids must be positive block ids"
    if p.remote_num_tokens != num_prompt_tokens:
        return (f"kv_transfer_params: the remote blocks hold {p.remote_num_tokens} tokens, the "
                f"prompt has {num_prompt_tokens} (not the prefill of this prompt)")
    if len(p.remote_block_ids) < need:
        return (f"kv_transfer_params: {len(p.remote_block_ids)} remote_block_ids for "
                f"{p.remote_num_tokens} tokens in blocks of {block_size} (need {need}; the "
                "engines must use the same --block-size)")
    return None


def params_to_json(p: KVTransferParams) -> dict[str, object]:
    """The HTTP form: every key of the side it describes, as vLLM writes it."""
    out = msgspec.to_builtins(p)
    assert isinstance(out, dict)
    out.setdefault("do_remote_decode", False)
    out.setdefault("do_remote_prefill", False)
    return out


# --------------------------------------------------------------------------------------------
# step diff (engine core -> workers)


class KVLoadOp(msgspec.Struct, array_like=True, kw_only=True):
    """Pull blocks of a remote engine into these local blocks (each rank its own heads)."""

    load_id: int  # the scheduler's name for this load until every rank reported it
    block_ids: bytes  # packed: local destination blocks
    remote_block_ids: bytes  # packed: the remote blocks, in the same order
    remote_key: str  # the lease the remote engine holds them under
    remote_engine_id: str
    remote_host: str
    remote_rank_ports: list[int]  # the remote ranks' block servers (tp size = len)


class KVExposeOp(msgspec.Struct, array_like=True):
    """Serve these blocks under ``key`` (a lease) until unexposed."""

    key: str
    block_ids: bytes  # packed


class KVConnectorMetadata(msgspec.Struct, array_like=True, kw_only=True, omit_defaults=True):
    """The connector's operations of one step; None in a step without any."""

    loads: list[KVLoadOp] = []
    cancel: bytes = b""  # packed load ids the scheduler gave up (timeout, abort): stop them
    expose: list[KVExposeOp] = []
    unexpose: list[str] = []  # leases that ended (done, expired): refuse further reads


def is_empty(meta: KVConnectorMetadata) -> bool:
    return not (meta.loads or meta.cancel or meta.expose or meta.unexpose)


def check_ops(meta: KVConnectorMetadata) -> None:
    """ProtocolError for a malformed plan (so a rank never half-starts one)."""
    for op in meta.loads:
        local, remote = unpack(op.block_ids), unpack(op.remote_block_ids)
        if len(local) != len(remote) or not local:
            raise ProtocolError(f"KV load {op.load_id}: {len(local)} local blocks for "
                                f"{len(remote)} remote ones")
        if not op.remote_rank_ports:
            raise ProtocolError(f"KV load {op.load_id} names no remote rank")


# --------------------------------------------------------------------------------------------
# workers -> engine core (every rank), and engine core -> engine core


class KVConnectorReport(msgspec.Struct, array_like=True, tag=37, kw_only=True):
    """Loads this rank settled since its last report. The core acts on a load only once every
    rank reported it; a load any rank failed is failed."""

    rank: int
    done: bytes = b""  # packed load ids, in place on this rank
    failed: bytes = b""  # packed load ids that failed or were cancelled on this rank
    reasons: list[str] = []  # one per failed id
    nbytes: int = 0  # bytes this rank pulled for ``done``
    seconds: list[float] = []  # per ``done`` id: from the op's arrival to in place
    transport: str = ""  # what moved them (tcp, shm, nixl)
    # packed load ids among ``failed`` whose lease the prefill rank refused (unknown key, an
    # ended lease, blocks outside it): counted apart, a sign of a guessed or stale key
    refused: bytes = b""


class KVLeaseControl(msgspec.Struct, array_like=True, tag=40, kw_only=True):
    """A decode engine core to a prefill engine core: keep these leases (the requests still
    wait here) or end them (loaded, given up or aborted). Fire and forget: a lost message
    costs at most one lease period."""

    engine_id: str  # the prefill engine meant (a restarted one on the same port ignores it)
    renew: list[str] = []
    release: list[str] = []


def load_ids(data: bytes) -> list[int]:
    return unpack(data)
