"""The cluster-secret handshake that opens every control connection, before anything else is read.

  sender (client)                                  receiver (listener)
  HELLO {protocol, client nonce}          ------>  checks the protocol tag
                                          <------  CHALLENGE {listener nonce, listener proof}
  checks the listener's proof                      (proof = HMAC-SHA256(secret, role | nonces))
  PROOF {client proof, namespace, rank, lane} -->  checks the proof (constant time), namespace, rank
                                          <------  WELCOME

Each side proves it holds the cluster secret without sending it; fresh nonces on both sides make a
recorded handshake useless. A side without a secret (tests, benchmarks) proves with an empty key and does
not check the other's proof, so a listener with a secret refuses every client without it. Every frame is
bounded (HANDSHAKE_FRAME_BYTES) and the whole handshake has one deadline.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.status import KVTransferError, TransferStatus

PROTOCOL = "tandem-kv-control/1"
HANDSHAKE_FRAME_BYTES = 512
_NONCE_BYTES = 32


class HandshakeRefused(KVTransferError):
    """The peer did not prove the cluster secret, or spoke another protocol."""

    def __init__(self, message: str):
        super().__init__(TransferStatus.UNAUTHENTICATED, message)


@dataclass(frozen=True)
class PeerHello:
    """Who an authenticated client says it is: its rank on the KV plane, the lane, and its namespace."""

    namespace: str
    rank: int
    lane: int


def _proof(secret: str | None, role: bytes, client_nonce: bytes, listener_nonce: bytes) -> bytes:
    key = secret.encode("ascii") if secret else b""
    return hmac.new(key, role + client_nonce + listener_nonce, hashlib.sha256).digest()


def _field(payload: object, name: str, kind: type) -> object:
    value = payload.get(name) if isinstance(payload, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HandshakeRefused(f"handshake field {name!r} missing or not {kind.__name__}")
    return value


def client_handshake(conn: ControlConnection, secret: str | None, hello: PeerHello, deadline: float) -> None:
    """Opens conn as a sender: proves the secret, checks the listener's proof (when this side has a
    secret) and says who it is. Raises HandshakeRefused (a listener without the secret, or one that
    refused us: the connection then ends) or KVTransferError (TIMEOUT, PEER_FAILED)."""
    client_nonce = os.urandom(_NONCE_BYTES)
    conn.send(Kind.HELLO, {"protocol": PROTOCOL, "nonce": client_nonce}, deadline)
    _, challenge = conn.receive(HANDSHAKE_FRAME_BYTES, deadline, (Kind.CHALLENGE,))
    listener_nonce = _field(challenge, "nonce", bytes)
    if secret is not None and not hmac.compare_digest(
            _field(challenge, "proof", bytes), _proof(secret, b"listener", client_nonce, listener_nonce)):
        raise HandshakeRefused(f"the KV receiver at {conn.peer} does not hold this cluster's secret")
    conn.send(Kind.PROOF, {"proof": _proof(secret, b"sender", client_nonce, listener_nonce),
                           "namespace": hello.namespace, "rank": hello.rank, "lane": hello.lane}, deadline)
    try:
        conn.receive(HANDSHAKE_FRAME_BYTES, deadline, (Kind.WELCOME,))
    except KVTransferError as exc:
        if exc.status == TransferStatus.TIMEOUT:
            raise
        raise HandshakeRefused(f"the KV receiver at {conn.peer} refused this sender: {exc.message}") from None


def listener_handshake(conn: ControlConnection, secret: str | None, namespace: str, deadline: float) -> PeerHello:
    """Opens conn as a receiver: checks the protocol tag, proves the secret, then checks the client's proof
    and namespace before anything else is read. Returns who the client is; raises HandshakeRefused (or
    KVTransferError for garbage, a timeout or a closed connection): the caller drops the connection."""
    _, hello = conn.receive(HANDSHAKE_FRAME_BYTES, deadline, (Kind.HELLO,))
    if _field(hello, "protocol", str) != PROTOCOL:
        raise HandshakeRefused("not the tandem KV control protocol")
    client_nonce = _field(hello, "nonce", bytes)
    if len(client_nonce) != _NONCE_BYTES:
        raise HandshakeRefused("bad nonce")
    listener_nonce = os.urandom(_NONCE_BYTES)
    conn.send(Kind.CHALLENGE, {"nonce": listener_nonce,
                               "proof": _proof(secret, b"listener", client_nonce, listener_nonce)}, deadline)
    _, proof = conn.receive(HANDSHAKE_FRAME_BYTES, deadline, (Kind.PROOF,))
    if secret is not None and not hmac.compare_digest(
            _field(proof, "proof", bytes), _proof(secret, b"sender", client_nonce, listener_nonce)):
        raise HandshakeRefused("missing or wrong cluster secret")
    peer = PeerHello(_field(proof, "namespace", str), _field(proof, "rank", int), _field(proof, "lane", int))
    if peer.namespace != namespace:
        raise HandshakeRefused(f"a sender of namespace {peer.namespace!r}, not {namespace!r}")
    return peer


def welcome(conn: ControlConnection, deadline: float) -> None:
    """Tells an authenticated client that the listener took it (the last handshake frame)."""
    conn.send(Kind.WELCOME, {}, deadline)
