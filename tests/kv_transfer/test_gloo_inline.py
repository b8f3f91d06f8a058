"""Inline gloo transfers (kv_transfer/dist/inline.py): a transfer's bytes ride the pair's control connection behind
its TRANSFER frame (by default every transfer's). A pair that carries only such transfers never opens a process
group (nor a gloo listener); one given a bound opens its group at the first transfer past it; a declined or
malformed inline transfer leaves the connection in step for the next; a receiver that takes fewer inline bytes than a
sender sends ends that connection and keeps serving. Sender and receiver run in this process, on threads, over
real sockets and real gloo."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kv_transfer import (DistRendezvous, KVTransferError, ReceivedKV, ReceiveFailed, SendRequest, TransferConfig,
                         TransferStatus, create_receiver, create_sender)
from kv_transfer.control.connection import Kind
from kv_transfer.control.exchange import await_status
from kv_transfer.layer_stream import LayerClock, LayerStream, StreamTail
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_hand_link import hand_link, inline_wire, send_frame_with_bytes
from tests.support.kv_peer import FP32
from tests.support.listening import listening_ports

BLOCKS = 64
NAMESPACE = "inline"
BLOCK_BYTES = FP32.block_nbytes
INLINE_MAX = 8 * BLOCK_BYTES  # up to 8 blocks inline, more on the group


def make_pair(receiver_inline_max: int = INLINE_MAX, sender_inline_max: int = INLINE_MAX, receiver_blocks=BLOCKS):
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=10, connect_timeout_s=10, dist_lanes=1)
    sender_pool, receiver_pool = FreeListPool(FP32, BLOCKS), FreeListPool(FP32, receiver_blocks)
    receiver = create_receiver(TransferConfig(**{**config.__dict__, "inline_max_bytes": receiver_inline_max}),
                               receiver_pool.view(), "gloo", DistRendezvous(0, 2, NAMESPACE), peers=[1])
    sender = create_sender(TransferConfig(**{**config.__dict__, "inline_max_bytes": sender_inline_max}),
                           sender_pool.view(), "gloo", DistRendezvous(1, 2, NAMESPACE))
    return sender, sender_pool, receiver, receiver_pool


@pytest.fixture
def pair():
    sender, sender_pool, receiver, receiver_pool = parts = make_pair()
    yield parts
    sender.close()
    receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS, "a KV block leaked"


def transfer(pair, request_id: str, num_blocks: int, seed: int) -> None:
    """One real transfer of num_blocks scattered sender blocks, checked bit for bit, its blocks given back."""
    sender, sender_pool, receiver, receiver_pool = pair
    blocks = sender_pool.allocate(num_blocks)
    fill_blocks(sender_pool.kv, blocks, seed)
    expected = blocks_bytes(sender_pool.kv, blocks)
    sender.send(receiver.address, SendRequest(request_id, tuple(blocks), num_blocks * FP32.block_size, 3)).result(20)
    got = receiver.wait(20)
    assert isinstance(got, ReceivedKV) and got.request_id == request_id, got
    assert blocks_bytes(receiver_pool.kv, got.block_ids) == expected
    receiver_pool.free(got.block_ids)


def test_small_transfers_open_no_group_and_cost_one_frame_each_way(pair):
    sender, _, receiver, _ = pair
    for i, num_blocks in enumerate([1, 3, 8]):
        transfer(pair, f"small-{i}", num_blocks, seed=i)
    link = sender._links[0]
    assert link.channel is None and all(r.channel is None for r in receiver._links)  # no gloo group, no listener
    handshake = {Kind.HELLO, Kind.CHALLENGE, Kind.PROOF, Kind.WELCOME}
    assert {k: n for k, n in link.conn.sent.items() if k not in handshake} == {Kind.TRANSFER: 3}  # no CONNECT
    assert {k: n for k, n in link.conn.received.items() if k not in handshake} == {Kind.STATUS: 3}


def test_by_default_every_transfer_rides_the_control_connection_and_no_gloo_socket_listens():
    """TransferConfig's default (inline_max_bytes None): transfers of any size, whole and layer-streamed, never open
    a process group, so no listener but the receiver's authenticated control listener ever exists (issue 32)."""
    listening_before = listening_ports()
    sender, sender_pool, receiver, receiver_pool = parts = make_pair(receiver_inline_max=None, sender_inline_max=None)
    try:
        control_port = int(receiver.address.target.rpartition(":")[2])
        for i, num_blocks in enumerate([1, 9, BLOCKS // 2, BLOCKS]):  # past any bound the old default had
            transfer(parts, f"any-{i}", num_blocks, seed=i)
        clock, stream, blocks, expected, handle = start_streamed(parts, "streamed", 12, seed=7)
        for layer in range(FP32.num_layers):
            clock.layer_done(layer)
        assert stream.finish(StreamTail(first_token=2), blocks)
        handle.result(20)
        got = receiver.wait(20)
        assert isinstance(got, ReceivedKV) and blocks_bytes(receiver_pool.kv, got.block_ids) == expected
        receiver_pool.free(got.block_ids)
        assert sender._links[0].channel is None and all(link.channel is None for link in receiver._links)
        assert {port for _, port in listening_ports() - listening_before} == {control_port}
    finally:
        sender.close()
        receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS, "a KV block leaked"


def test_a_pair_opens_its_group_at_the_first_large_transfer_and_keeps_both_ways(pair):
    sender, _, _, _ = pair
    transfer(pair, "small", 2, seed=1)
    assert sender._links[0].channel is None
    transfer(pair, "large", 9, seed=2)  # past INLINE_MAX: on the process group
    channel = sender._links[0].channel
    assert channel is not None and channel.broken is None
    for i, num_blocks in enumerate([4, 12, 1]):
        transfer(pair, f"mixed-{i}", num_blocks, seed=3 + i)
    assert sender._links[0].channel is channel  # the same epoch throughout


def test_a_declined_inline_transfer_leaves_the_connection_in_step():
    sender, sender_pool, receiver, receiver_pool = parts = make_pair(receiver_blocks=8)
    held = receiver_pool.allocate(6)
    try:
        blocks = tuple(sender_pool.allocate(4))  # more than the receiver has free: REJECTED_NO_BLOCKS
        with pytest.raises(KVTransferError) as failed:
            sender.send(receiver.address, SendRequest("too-big", blocks, 4 * FP32.block_size, 1)).result(20)
        assert failed.value.status == TransferStatus.REJECTED_NO_BLOCKS
        assert isinstance(receiver.wait(5), ReceiveFailed)
        conn = sender._links[0].conn
        receiver_pool.free(held)
        transfer(parts, "next", 3, seed=4)  # its bytes were skipped: the next transfer reads right
        assert sender._links[0].conn is conn
    finally:
        sender.close()
        receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == 8


def test_inline_bytes_that_do_not_match_the_manifest_are_malformed_and_skipped(pair):
    _, sender_pool, receiver, receiver_pool = pair
    blocks = sender_pool.allocate(2)
    fill_blocks(sender_pool.kv, blocks, 9)
    outgoing = prepare_outgoing(sender_pool.view(), SendRequest("liar", tuple(blocks), 2 * FP32.block_size, 1),
                                StagingPool("cpu"))
    outgoing.gather_all()
    frame, data = inline_wire(outgoing, 0)
    data += b"extra!!!"
    config = TransferConfig(transport="gloo", connect_timeout_s=10)
    deadline = time.monotonic() + 10
    with hand_link(receiver.address, config, NAMESPACE, 1, with_group=False) as (conn, _):
        send_frame_with_bytes(conn, replace(frame, inline_nbytes=len(data)), data, deadline)
        assert await_status(conn, 0, deadline)[0] == TransferStatus.MALFORMED
        outgoing = prepare_outgoing(sender_pool.view(), SendRequest("honest", tuple(blocks), 2 * FP32.block_size, 1),
                                    StagingPool("cpu"))
        outgoing.gather_all()
        send_frame_with_bytes(conn, *inline_wire(outgoing, 1), deadline)
        assert await_status(conn, 1, deadline)[0] == TransferStatus.OK  # the same connection, in step
    assert isinstance(receiver.wait(5), ReceiveFailed)
    got = receiver.wait(5)
    assert isinstance(got, ReceivedKV) and blocks_bytes(receiver_pool.kv, got.block_ids) == blocks_bytes(
        sender_pool.kv, blocks)
    receiver_pool.free(got.block_ids)
    sender_pool.free(blocks)


def test_a_receiver_taking_fewer_inline_bytes_ends_that_connection_and_keeps_serving():
    sender, sender_pool, receiver, receiver_pool = make_pair(receiver_inline_max=2 * BLOCK_BYTES)
    try:
        blocks = tuple(sender_pool.allocate(4))  # inline for the sender, too many inline bytes for the receiver
        with pytest.raises(KVTransferError) as failed:
            sender.send(receiver.address, SendRequest("over", blocks, 4 * FP32.block_size, 1)).result(20)
        assert failed.value.status == TransferStatus.PEER_FAILED
        transfer((sender, sender_pool, receiver, receiver_pool), "within", 2, seed=5)  # a fresh connection
    finally:
        sender.close()
        receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS


def start_streamed(pair, request_id: str, num_blocks: int, seed: int):
    """A layer-streamed send whose layers the test releases (LayerClock.layer_done); (clock, stream, blocks,
    expected bytes, handle). stream.finish(tail, blocks) hands the blocks to the transfer."""
    sender, sender_pool, receiver, _ = pair
    blocks = tuple(sender_pool.allocate(num_blocks))
    fill_blocks(sender_pool.kv, blocks, seed)
    clock = LayerClock(FP32.num_layers, torch.device("cpu"))
    stream = LayerStream(clock)
    handle = sender.send(receiver.address, SendRequest(request_id, blocks, num_blocks * FP32.block_size, None,
                                                       stream=stream))
    return clock, stream, blocks, blocks_bytes(sender_pool.kv, blocks), handle


def test_a_streamed_inline_transfer_lands_and_defers_other_frames_until_written(pair):
    """A CANCEL frame for an earlier transfer (its handle cancelled late) while a streamed transfer writes its layers
    waits until the stream is written: the stream stays in step, the stale CANCEL is ignored."""
    sender, _, receiver, receiver_pool = pair
    earlier = sender.send(receiver.address, SendRequest("earlier", tuple(pair[1].allocate(2)), 2 * FP32.block_size, 1))
    earlier.result(20)
    receiver_pool.free(receiver.wait(5).block_ids)
    clock, stream, blocks, expected, handle = start_streamed(pair, "streamed", 3, seed=7)
    clock.layer_done(0)
    time.sleep(0.2)  # layer 0 is on the connection
    earlier.cancel()  # its CANCEL frame must not land between this stream's bytes
    for layer in range(1, FP32.num_layers):
        clock.layer_done(layer)
    assert stream.finish(StreamTail(first_token=5), blocks)
    handle.result(20)
    got = receiver.wait(20)
    assert isinstance(got, ReceivedKV) and got.manifest.first_token == 5, got
    assert blocks_bytes(receiver_pool.kv, got.block_ids) == expected
    receiver_pool.free(got.block_ids)
    assert sender._links[0].channel is None  # no group for any of it
    transfer(pair, "after", 2, seed=8)


def test_a_declined_streamed_inline_transfer_is_read_past():
    sender, sender_pool, receiver, receiver_pool = parts = make_pair(receiver_blocks=8)
    held = receiver_pool.allocate(6)
    try:
        clock, stream, blocks, _, handle = start_streamed(parts, "no-room", 4, seed=2)  # 2 blocks free: declined
        for layer in range(FP32.num_layers):
            clock.layer_done(layer)
        assert stream.finish(StreamTail(first_token=1), blocks)
        with pytest.raises(KVTransferError) as failed:
            handle.result(20)
        assert failed.value.status == TransferStatus.REJECTED_NO_BLOCKS
        assert isinstance(receiver.wait(5), ReceiveFailed)
        conn = sender._links[0].conn
        receiver_pool.free(held)
        transfer(parts, "next", 3, seed=4)
        assert sender._links[0].conn is conn  # the same connection, still in step
    finally:
        sender.close()
        receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == 8
