"""The rank transports' control plane (kv_transfer/control/): a receiver's listener binds the address it is
given, drops every peer that does not prove the cluster secret (none, a wrong one, garbage, too slow, not a
sender of this receiver) before anything else is read, counts the drops and keeps serving; a transfer
costs one frame out and one frame back. Real sockets and real gloo, sender and receiver on threads here."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

import pytest

from kv_transfer import (DistRendezvous, KVTransferError, ReceivedKV, SendRequest, TransferConfig, TransferStatus,
                         create_receiver, create_sender)
from kv_transfer.control.connection import ControlClosed, ControlConnection, Kind
from kv_transfer.control.handshake import PROTOCOL, HandshakeRefused, PeerHello, client_handshake
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_peer import FP32

SECRET = "s3cret-" + "x" * 24
BLOCKS = 32
NAMESPACE = "control"


@pytest.fixture(params=["gloo-group", "gloo-inline", "ipc"])
def pair(request):
    """A receiver (rank 0, serving sender rank 1) holding SECRET, and a real sender holding it too (gloo: its
    bytes on the pair's process group, or inline on the control connection)."""
    transport = request.param.split("-")[0]
    config = TransferConfig(transport=transport, kv_transfer_timeout_s=10, connect_timeout_s=2,
                            cluster_secret=SECRET, dist_lanes=1, inline_max_bytes=0 if "group" in request.param
                            else TransferConfig.inline_max_bytes)
    sender_pool, receiver_pool = FreeListPool(FP32, BLOCKS), FreeListPool(FP32, BLOCKS)
    sender_pool.kv.share_memory_()  # ipc maps it
    receiver = create_receiver(config, receiver_pool.view(), transport, DistRendezvous(0, 2, NAMESPACE), peers=[1])
    sender = create_sender(config, sender_pool.view(), transport, DistRendezvous(1, 2, NAMESPACE))
    yield sender, sender_pool, receiver, receiver_pool
    sender.close()
    receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS, "a KV block leaked"


def transfer(sender, sender_pool, receiver, receiver_pool, request_id: str, seed: int) -> None:
    """One real transfer, checked bit for bit, its blocks given back."""
    blocks = sender_pool.allocate(3)
    fill_blocks(sender_pool.kv, blocks, seed)
    expected = blocks_bytes(sender_pool.kv, blocks)
    sender.send(receiver.address, SendRequest(request_id, tuple(blocks), 10, 7)).result(20)
    got = receiver.wait(20)
    assert isinstance(got, ReceivedKV) and got.request_id == request_id, got
    assert blocks_bytes(receiver_pool.kv, got.block_ids) == expected
    receiver_pool.free(got.block_ids)


def connect(receiver) -> ControlConnection:
    host, _, port = receiver.address.target.rpartition(":")
    return ControlConnection(socket.create_connection((host, int(port)), timeout=5))


def assert_dropped(conn: ControlConnection) -> None:
    """The listener closed the connection without reading anything more from it."""
    with pytest.raises(ControlClosed):
        conn.receive(1024, time.monotonic() + 10)
    conn.close()


def wait_drops(receiver, reason: str, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while receiver.dropped_connections.get(reason, 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.dropped_connections.get(reason, 0) == count, receiver.dropped_connections


def test_the_listener_binds_the_address_it_was_given_only():
    """Bound to 127.0.0.2, nothing answers on 127.0.0.1 at that port: not all interfaces."""
    config = TransferConfig(transport="gloo", cluster_secret=SECRET)
    receiver = create_receiver(config, FreeListPool(FP32, 4).view(), "gloo", DistRendezvous(0, 2), peers=[1],
                               host="127.0.0.2")
    try:
        host, _, port = receiver.address.target.rpartition(":")
        assert host == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
    finally:
        receiver.close()


def test_one_frame_out_and_one_back_per_transfer(pair):
    sender, sender_pool, receiver, receiver_pool = pair
    transfer(sender, sender_pool, receiver, receiver_pool, "first", seed=1)  # connects (and builds the group)
    link = sender._links[0]
    sent, received = dict(link.conn.sent), dict(link.conn.received)
    for i in range(3):
        transfer(sender, sender_pool, receiver, receiver_pool, f"next-{i}", seed=2 + i)
    assert {k: v - sent.get(k, 0) for k, v in link.conn.sent.items() if v != sent.get(k, 0)} == {Kind.TRANSFER: 3}
    assert {k: v - received.get(k, 0) for k, v in link.conn.received.items()
            if v != received.get(k, 0)} == {Kind.STATUS: 3}


@pytest.mark.parametrize("secret, rank, reason", [(None, 1, "unauthenticated"), (SECRET, 9, "not_a_peer")],
                         ids=["no-secret", "rank-not-served"])
def test_a_refused_sender_is_dropped_counted_and_the_receiver_keeps_serving(pair, secret, rank, reason):
    sender, sender_pool, receiver, receiver_pool = pair
    conn = connect(receiver)
    with pytest.raises(HandshakeRefused):
        client_handshake(conn, secret, PeerHello(NAMESPACE, rank, 0), time.monotonic() + 10)
    conn.close()
    wait_drops(receiver, reason)
    transfer(sender, sender_pool, receiver, receiver_pool, f"after-{reason}", seed=5)


def test_a_wrong_secret_is_dropped_either_way(pair):
    """A sender with another secret refuses the listener (it cannot prove ours); one that proves a wrong
    secret anyway is dropped before its rank is even looked at."""
    sender, sender_pool, receiver, receiver_pool = pair
    conn = connect(receiver)
    with pytest.raises(HandshakeRefused, match="does not hold this cluster's secret"):
        client_handshake(conn, "another-secret-" + "y" * 20, PeerHello(NAMESPACE, 1, 0), time.monotonic() + 10)
    conn.close()
    conn = connect(receiver)
    client_nonce = os.urandom(32)
    conn.send(Kind.HELLO, {"protocol": PROTOCOL, "nonce": client_nonce}, time.monotonic() + 5)
    _, challenge = conn.receive(512, time.monotonic() + 5, (Kind.CHALLENGE,))
    forged = hmac.new(b"wrong", b"sender" + client_nonce + challenge["nonce"], hashlib.sha256).digest()
    conn.send(Kind.PROOF, {"proof": forged, "namespace": NAMESPACE, "rank": 1, "lane": 0}, time.monotonic() + 5)
    assert_dropped(conn)
    wait_drops(receiver, "unauthenticated")
    transfer(sender, sender_pool, receiver, receiver_pool, "after-wrong-secret", seed=6)


def test_garbage_is_dropped(pair):
    sender, sender_pool, receiver, receiver_pool = pair
    conn = connect(receiver)
    conn.sock.sendall(os.urandom(4096))
    assert_dropped(conn)
    wait_drops(receiver, "garbage")
    transfer(sender, sender_pool, receiver, receiver_pool, "after-garbage", seed=7)


def test_a_silent_peer_is_dropped_after_the_handshake_deadline(pair):
    sender, sender_pool, receiver, receiver_pool = pair
    conn = connect(receiver)  # says nothing
    assert_dropped(conn)
    wait_drops(receiver, "timeout")
    transfer(sender, sender_pool, receiver, receiver_pool, "after-silence", seed=8)


def test_a_sender_without_the_secret_fails_unauthenticated_and_frees(pair):
    _, _, receiver, receiver_pool = pair
    pool = FreeListPool(FP32, BLOCKS)
    pool.kv.share_memory_()
    config = TransferConfig(transport=receiver.address.transport, connect_timeout_s=2, dist_lanes=1)
    stranger = create_sender(config, pool.view(), receiver.address.transport, DistRendezvous(1, 2, NAMESPACE))
    try:
        handle = stranger.send(receiver.address, SendRequest("stranger", tuple(pool.allocate(2)), 5, 1))
        with pytest.raises(KVTransferError) as failed:
            handle.result(20)
        assert failed.value.status == TransferStatus.UNAUTHENTICATED, failed.value
        assert pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS
    finally:
        stranger.close()
    wait_drops(receiver, "unauthenticated")
