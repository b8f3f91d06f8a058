"""gRPC transfers on long-lived Push streams (sessions), sender and receiver in this process: the messages each
transfer costs (counted), streams reused after every success and replaced after every failure, and each
failure ending with every block free on both sides and the pair delivering the next transfer bit for bit.
Every test runs both ways a transfer travels: small (checksums in the manifest, no thread hop) and trailing
(each run's checksum after its bytes), the latter forced by setting the small threshold to 0."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from kv_transfer import (KVTransferError, ReceivedKV, ReceiveFailed, SendRequest, TransferConfig, TransferStatus,
                         create_receiver, create_sender)
from kv_transfer.grpc import push
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import BF16, FP32

TIMEOUT_S = 20.0
SENDER_BLOCKS = 160
CHUNK_BYTES = 4096  # two FP32 blocks per data chunk: a 6-block run is 3 chunks


@dataclass
class Pair:
    sender: object
    pool: FreeListPool  # the sender's
    side: sc.Side
    small: bool

    @property
    def receiver(self):
        return self.side.receiver

    def send(self, key: str, blocks, seed: int):
        self.pool.take(blocks)
        fill_blocks(self.pool.kv, blocks, seed)
        expected = blocks_bytes(self.pool.kv, blocks)
        request = SendRequest(key, tuple(blocks), len(blocks) * FP32.block_size, first_token=seed)
        return self.sender.send(self.receiver.address, request), expected

    def deliver(self, key: str, blocks, seed: int) -> None:
        """Sends and checks the transfer arrived bit for bit; frees the received blocks."""
        handle, expected = self.send(key, blocks, seed)
        handle.result(TIMEOUT_S)
        got = self.receiver.wait(TIMEOUT_S)
        assert isinstance(got, ReceivedKV) and got.request_id == key, got
        assert blocks_bytes(self.side.pool.kv, got.block_ids) == expected
        self.side.pool.free(got.block_ids)

    def fails(self, handle, status: TransferStatus, receiver_status: TransferStatus | None = None) -> None:
        """The handle fails with status, the receiver reports receiver_status (default: the same)."""
        with pytest.raises(KVTransferError) as failed:
            handle.result(TIMEOUT_S)
        assert failed.value.status == status, failed.value
        outcome = self.receiver.wait(TIMEOUT_S)
        assert isinstance(outcome, ReceiveFailed), outcome
        assert outcome.status == (receiver_status or status), outcome

    def assert_whole(self) -> None:
        assert self.pool.num_free == SENDER_BLOCKS, "the sender leaks blocks"
        assert self.side.pool.num_free == sc.RECEIVER_BLOCKS, "the receiver leaks blocks"


def _config(timeout_s: float = TIMEOUT_S) -> TransferConfig:
    return TransferConfig(transport="grpc", kv_transfer_timeout_s=timeout_s, connect_timeout_s=30,
                          grpc_chunk_bytes=CHUNK_BYTES)


def _side(config: TransferConfig) -> sc.Side:
    pool = sc.receiver_pool(FP32)
    gate = sc.Gate(pool)
    return sc.Side("float32", pool, gate, create_receiver(config, gate.view(), "grpc", host="127.0.0.1", port=0))


@pytest.fixture(params=["small", "trailing"])
def pair(request, monkeypatch):
    if request.param == "trailing":
        monkeypatch.setattr(push, "SMALL_TRANSFER_BYTES", 0)
    config = _config()
    side = _side(config)
    pool = FreeListPool(FP32, SENDER_BLOCKS)
    sender = create_sender(config, pool.view(), "grpc")
    made = Pair(sender, pool, side, request.param == "small")
    yield made
    made.sender.close()
    made.receiver.close()  # a test may have put another receiver in place
    made.assert_whole()


def _delta(after, before) -> dict:
    return {key: after[key] - before[key] for key in set(after) | set(before) if after[key] != before[key]}


def test_each_transfer_is_its_messages_out_and_one_ack_back_on_one_stream(pair):
    """After the first transfer opened the stream, each transfer adds its manifest, its data chunks (and in
    the trailing way one checksum per run) and exactly one ack; no stream is opened and no accept ack sent."""
    pair.deliver("first", (1, 2, 3, 9), seed=1)
    assert pair.sender.streams.counts["streams_opened"] == 1 and pair.receiver.counts["sessions"] == 1
    for i in range(4):
        before, received_before = pair.sender.streams.counts.copy(), pair.receiver.counts.copy()
        pair.deliver(f"next-{i}", (10, 11, 12, 13, 14, 15, 40), seed=2 + i)  # runs of 6 blocks and 1 block
        sent = _delta(pair.sender.streams.counts, before)
        runs = {} if pair.small else {"run_checksum": 2}
        assert sent == {"manifest": 1, "data": 4, "ack": 1, **runs}, sent  # 4 KiB chunks: 12 KiB + 2 KiB
        assert _delta(pair.receiver.counts, received_before) == {"final": 1}
    assert pair.sender.streams.counts["streams_opened"] == 1 and pair.receiver.counts["sessions"] == 1
    pair.assert_whole()


def test_transfers_in_flight_at_once_take_a_stream_each_and_reuse_them(pair):
    """Three waves of four transfers at once open at most four streams in all (one per transfer in flight;
    a stream whose transfer has ended serves the next), and every transfer arrives bit for bit."""
    for wave in range(3):
        started = [pair.send(f"w{wave}-{i}", range(8 * i, 8 * i + 5), seed=10 * wave + i) for i in range(4)]
        for handle, _ in started:
            handle.result(TIMEOUT_S)
        got = {o.request_id: o for o in (pair.receiver.wait(TIMEOUT_S) for _ in started)}
        for i, (_, expected) in enumerate(started):
            outcome = got[f"w{wave}-{i}"]
            assert blocks_bytes(pair.side.pool.kv, outcome.block_ids) == expected
            pair.side.pool.free(outcome.block_ids)
    assert 1 <= pair.sender.streams.counts["streams_opened"] <= 4
    pair.assert_whole()


def test_streams_beyond_the_idle_limit_are_half_closed_after_their_ack_not_cancelled(pair, monkeypatch):
    """With room for one idle stream, three of four streams are closed right after their OK ack: by a
    half-close, which the receiver reads between transfers. A cancel there could cancel the receiver's write
    of that very ack (it would free the blocks and report PEER_FAILED while the sender counted it delivered)."""
    from kv_transfer.grpc import streams

    monkeypatch.setattr(streams, "IDLE_STREAMS_PER_RECEIVER", 1)
    for wave in range(3):
        started = [pair.send(f"w{wave}-{i}", range(8 * i, 8 * i + 5), seed=10 * wave + i) for i in range(4)]
        for handle, _ in started:
            handle.result(TIMEOUT_S)
        got = [pair.receiver.wait(TIMEOUT_S) for _ in started]
        assert all(isinstance(o, ReceivedKV) for o in got), got
        for outcome in got:
            pair.side.pool.free(outcome.block_ids)
    assert pair.sender.streams.num_idle <= 1
    pair.assert_whole()


def _after_a_failure_a_fresh_stream_delivers(pair: Pair) -> None:
    opened = pair.sender.streams.counts["streams_opened"]
    pair.deliver("after", (50, 51, 52), seed=99)
    assert pair.sender.streams.counts["streams_opened"] == opened + 1
    pair.assert_whole()


def test_receiver_cancel_on_a_session(pair):
    pair.deliver("warm", (1, 2), seed=1)
    pair.receiver.cancel("unwanted")
    handle, _ = pair.send("unwanted", range(20, 26), seed=2)
    pair.fails(handle, TransferStatus.CANCELLED)
    _after_a_failure_a_fresh_stream_delivers(pair)


def test_no_room_on_a_session(pair):
    pair.deliver("warm", (1, 2), seed=1)
    held = pair.side.pool.allocate(sc.RECEIVER_BLOCKS - 4)
    handle, _ = pair.send("too-big", range(20, 26), seed=2)
    pair.fails(handle, TransferStatus.REJECTED_NO_BLOCKS)
    assert pair.side.pool.num_free == 4
    pair.side.pool.free(held)
    _after_a_failure_a_fresh_stream_delivers(pair)


def test_more_blocks_than_the_receiver_pool_on_a_session_is_malformed(pair):
    pair.deliver("warm", (1, 2), seed=1)
    handle, _ = pair.send("beyond", range(0, sc.RECEIVER_BLOCKS + 4), seed=2)
    pair.fails(handle, TransferStatus.MALFORMED)
    _after_a_failure_a_fresh_stream_delivers(pair)


def test_another_layout_on_a_session_is_refused(pair):
    pair.deliver("warm", (1, 2), seed=1)
    other = FreeListPool(BF16, 8)
    other.take((1, 2))
    sender = create_sender(_config(), other.view(), "grpc")
    try:
        handle = sender.send(pair.receiver.address, SendRequest("bf16", (1, 2), 2 * BF16.block_size, 3))
        pair.fails(handle, TransferStatus.REJECTED_FINGERPRINT)
        assert other.num_free == 8
    finally:
        sender.close()
    pair.deliver("same-stream", (3, 4), seed=4)  # the other sender's failure did not touch this pair's stream
    pair.assert_whole()


def test_sender_cancel_mid_transfer_on_a_session(pair):
    pair.deliver("warm", (1, 2), seed=1)
    pair.side.gate.entered.clear()
    pair.side.gate.open.clear()
    handle, _ = pair.send("cancel-me", range(30, 46), seed=2)
    assert pair.side.gate.entered.wait(TIMEOUT_S)  # the receiver is inside allocate for it
    handle.cancel()
    pair.side.gate.open.set()
    pair.fails(handle, TransferStatus.CANCELLED, TransferStatus.PEER_FAILED)
    _after_a_failure_a_fresh_stream_delivers(pair)


def test_sender_deadline_on_a_session(monkeypatch):
    """The receiver holds the transfer (inside allocate) past the sender's deadline (2 x its timeout): the
    sender fails TIMEOUT and drops the stream; the receiver sees the stream cancelled and frees."""
    config = _config(timeout_s=0.5)
    side = _side(config)
    pool = FreeListPool(FP32, SENDER_BLOCKS)
    pair = Pair(create_sender(config, pool.view(), "grpc"), pool, side, True)
    try:
        pair.deliver("warm", (1, 2), seed=1)
        side.gate.open.clear()
        handle, _ = pair.send("held", range(20, 24), seed=2)
        with pytest.raises(KVTransferError) as failed:
            handle.result(TIMEOUT_S)
        assert failed.value.status == TransferStatus.TIMEOUT, failed.value
        side.gate.open.set()
        outcome = side.receiver.wait(TIMEOUT_S)
        assert isinstance(outcome, ReceiveFailed) and outcome.request_id == "held", outcome
        _after_a_failure_a_fresh_stream_delivers(pair)
    finally:
        side.gate.open.set()
        pair.sender.close()
        side.receiver.close()


def test_a_receiver_closed_between_transfers_ends_its_sessions_at_once(pair):
    """Idle sessions do not hold the receiver's close for its transfer timeout; the sender's next transfer
    to the closed receiver fails without a hang and frees its blocks."""
    pair.deliver("warm", (1, 2), seed=1)
    began = time.monotonic()
    pair.receiver.close()
    assert time.monotonic() - began < TIMEOUT_S / 4, "close waited for the idle session"
    handle, _ = pair.send("late", (5, 6), seed=2)
    with pytest.raises(KVTransferError) as failed:
        handle.result(TIMEOUT_S)
    assert failed.value.status == TransferStatus.PEER_FAILED, failed.value
    pair.side = _side(_config())  # the fixture closes this one
    pair.deliver("new-receiver", (7, 8), seed=3)
    pair.assert_whole()


def test_a_handler_cancelled_after_its_ack_ends_the_stream(pair, monkeypatch):
    """The receiver's handler is cancelled as its final ack goes out: it frees and reports PEER_FAILED, and
    ends the stream with a status, so the sender does not reuse it: the next transfer opens a fresh one."""
    import asyncio

    pair.deliver("warm", (1, 2), seed=1)
    write_final = pair.receiver._write_final

    async def cancelled_while_written(context, final):
        asyncio.current_task().cancel()  # raised at the write's await, after the ack went to gRPC
        await write_final(context, final)

    monkeypatch.setattr(pair.receiver, "_write_final", cancelled_while_written)
    handle, _ = pair.send("cancelled", range(20, 24), seed=2)
    failed = handle.exception(TIMEOUT_S)  # None if the ack went out before the cancel reached the write
    assert failed is None or failed.status == TransferStatus.PEER_FAILED, failed
    outcome = pair.receiver.wait(TIMEOUT_S)
    assert isinstance(outcome, ReceiveFailed) and "could not ack" in outcome.message, outcome
    monkeypatch.undo()
    deadline = time.monotonic() + TIMEOUT_S  # the outcome is in before the stream's status went out: a transfer
    while pair.sender.streams.num_idle and time.monotonic() < deadline:  # sent at once may still take the
        time.sleep(0.01)  # ended stream and, when a data write finds it over, fail (see kv_transfer.md)
    _after_a_failure_a_fresh_stream_delivers(pair)


def test_a_stream_the_receiver_ended_between_transfers_is_replaced_without_a_failure(pair):
    """The receiver ends an idle session (here: its handler cancelled between transfers) while the sender
    still holds the stream as idle: the next transfer finds it ended before the receiver read its manifest
    (the stream's trailing metadata counts the transfers it began) and goes again on a fresh stream."""
    import asyncio

    pair.deliver("warm", (1, 2), seed=1)
    sessions = list(pair.receiver._idle_sessions)
    assert len(sessions) == 1
    stale = pair.sender.streams._idle[pair.receiver.address.target][0]
    pair.receiver._loop.run(_cancel(sessions[0]))
    pair.sender._loop.run(asyncio.wait_for(stale.call.code(), 10))  # the sender's stream has ended...
    stale.call.done = lambda: False  # ...but looks open, as before its status is in: it is handed out
    _after_a_failure_a_fresh_stream_delivers(pair)
    assert pair.receiver.inbox.poll() == []  # the receiver never saw the first attempt


async def _cancel(task) -> None:
    task.cancel()


def test_two_sessions_from_two_senders_share_the_admission_limit():
    """Sessions are admitted per transfer: a receiver with one slot lets one sender's transfer through while
    the other's waits in the queue; both are delivered."""
    config = TransferConfig(transport="grpc", kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=30,
                            grpc_max_concurrent_transfers=1, grpc_max_queued_transfers=4)
    side = _side(config)
    pools = [FreeListPool(FP32, SENDER_BLOCKS) for _ in range(2)]
    senders = [create_sender(config, pool.view(), "grpc") for pool in pools]
    pairs = [Pair(sender, pool, side, True) for sender, pool in zip(senders, pools)]
    try:
        pairs[0].deliver("a0", (1, 2), seed=1)
        pairs[1].deliver("b0", (1, 2), seed=2)
        side.gate.entered.clear()
        side.gate.open.clear()
        first, _ = pairs[0].send("a1", (3, 4, 5), seed=3)
        assert side.gate.entered.wait(TIMEOUT_S)
        threading.Timer(0.3, side.gate.open.set).start()
        second, _ = pairs[1].send("b1", (3, 4, 5), seed=4)
        first.result(TIMEOUT_S)
        second.result(TIMEOUT_S)
        for _ in range(2):
            side.pool.free(side.receiver.wait(TIMEOUT_S).block_ids)
        assert side.receiver.admission.active == 0 and side.receiver.admission.queued == 0
    finally:
        side.gate.open.set()
        for sender in senders:
            sender.close()
        side.receiver.close()
    assert all(pool.num_free == SENDER_BLOCKS for pool in pools) and side.pool.num_free == sc.RECEIVER_BLOCKS
