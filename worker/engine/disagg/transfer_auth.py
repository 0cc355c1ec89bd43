"""Who may use a worker's transfer server: other workers of this cluster, and nobody else.

The transfer server (kv_transfer.TransferServer) hands out KV blocks and encoder
outputs, which are users' prompts in another form, so a process that merely reaches
its port must get nothing.  The credential is the cluster's worker token
(common/runtime_dir.py: the same secret the broker registers workers by):

* every message to a transfer server carries it (``auth``); the server answers any
  other message with a bare 401 and does nothing else;
* across hosts the link is encrypted: a server bound beyond loopback is a CURVE
  server whose key pair is derived from the token, and a client reaching a
  non-loopback peer uses CURVE with that derived public key.  Only token holders
  can compute the key, so nobody else even completes the handshake, and the token
  (and the blocks) never cross the network in the clear.  On loopback the link stays
  plain: CURVE costs ~5x the copy throughput (270 vs 1400 MB/s measured here) and
  buys nothing where only this host's processes can listen.

The credential is process-wide, like the ZeroMQ context the transfers use: the
worker sets it from ``--worker-token-file`` before the engine starts
(:func:`configure`); an engine built without a worker process (tests, benchmarks)
reads the runtime directory's token, as every local worker does.
"""
from __future__ import annotations

import hashlib
import ipaddress
import threading
from typing import Optional

import zmq
import zmq.utils.z85 as z85

from common import runtime_dir, security

AUTH_FIELD = "auth"
_KEY_DOMAIN = b"tokserve transfer link v1\0"


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TransferAuth:
    def __init__(self, token: str):
        self.token = token
        secret = z85.encode(hashlib.sha256(_KEY_DOMAIN + token.encode()).digest())
        self.keys = security.CurveKeys(zmq.curve_public(secret), secret)

    def stamp(self, msg: dict) -> dict:
        return {**msg, AUTH_FIELD: self.token}

    def admits(self, msg: dict) -> bool:
        return runtime_dir.token_matches(self.token, msg.get(AUTH_FIELD))

    def encrypts(self, host: str) -> bool:
        return not is_loopback_host(host)

    def secure_server(self, sock: zmq.Socket, bind_host: str) -> None:
        """Before bind: CURVE unless the server listens on loopback only."""
        if self.encrypts(bind_host):
            security.configure_server(sock, self.keys)

    def secure_client(self, sock: zmq.Socket, peer_host: str) -> None:
        """Before connect: CURVE to a peer beyond loopback (a throwaway client key pair:
        the token inside the messages is what authenticates us)."""
        if self.encrypts(peer_host):
            security.configure_client(sock, self.keys.public)


_lock = threading.Lock()
_current: Optional[TransferAuth] = None


def configure(token: str) -> None:
    global _current
    with _lock:
        _current = TransferAuth(token)


def current() -> TransferAuth:
    global _current
    with _lock:
        if _current is None:
            _current = TransferAuth(runtime_dir.load_or_create_token(runtime_dir.WORKER))
        return _current
