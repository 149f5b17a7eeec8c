"""Shared-secret authentication for tcp:// transport (multi-node).

Both sides of every tcp connection derive their CURVE key pairs from one shared secret
(``TANDEM_SECRET``), so nothing but the secret has to be distributed. The server key pair
(the binding side) is derived under its own label; a connecting peer that does not hold the
secret cannot compute the server's public key and its CURVE handshake fails, so it never
sees or sends a single message. ipc:// endpoints rely on the 0700 directory instead.

``hello_mac`` additionally binds a ``WorkerHello`` to the secret (defence in depth, and it
lets the core give a clear error for a rank started with the wrong secret).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

import zmq
from zmq.utils import z85

SECRET_ENV = "TANDEM_SECRET"
_SERVER_LABEL = b"tandem/curve/server/v1"
_CLIENT_LABEL = b"tandem/curve/client/v1"
_HELLO_LABEL = b"tandem/hello/v1"


def secret_from_env(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared secret from TANDEM_SECRET, or None when unset or empty."""
    value = env.get(SECRET_ENV, "")
    return value.encode() if value else None


def _derive(secret: bytes, label: bytes) -> bytes:
    # HMAC-SHA256 as a KDF: 32 uniformly random-looking bytes per label. Any 32 bytes are a
    # valid Curve25519 secret key (libzmq clamps them).
    return hmac.new(secret, label, hashlib.sha256).digest()


def curve_keypair(secret: bytes, *, server: bool) -> tuple[bytes, bytes]:
    """(public, secret) Z85-encoded CURVE keys derived deterministically from ``secret``."""
    if not secret:
        raise ValueError("an empty secret cannot protect a tcp endpoint; set TANDEM_SECRET")
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE; cannot secure tcp:// endpoints")
    secret_key = z85.encode(_derive(secret, _SERVER_LABEL if server else _CLIENT_LABEL))
    return zmq.curve_public(secret_key), secret_key


def apply_curve(sock: zmq.Socket, secret: bytes, *, server: bool) -> None:
    """Configure CURVE on ``sock`` (must run before bind/connect)."""
    server_public, server_secret = curve_keypair(secret, server=True)
    if server:
        sock.curve_server = True
        sock.curve_publickey = server_public
        sock.curve_secretkey = server_secret
    else:
        public, secret_key = curve_keypair(secret, server=False)
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret_key


def hello_mac(secret: bytes, rank: int, world_size: int, pid: int, hostname: str) -> bytes:
    """MAC for WorkerHello.auth over the fields that identify a rank."""
    msg = f"{rank}|{world_size}|{pid}|{hostname}".encode()
    return hmac.new(_derive(secret, _HELLO_LABEL), msg, hashlib.sha256).digest()


def verify_hello_mac(
    secret: bytes, mac: bytes, rank: int, world_size: int, pid: int, hostname: str
) -> bool:
    """Constant-time check of a WorkerHello.auth value."""
    return hmac.compare_digest(mac, hello_mac(secret, rank, world_size, pid, hostname))
