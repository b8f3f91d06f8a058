"""The gRPC receiver's admission queue and cancel memory, and the data-chunk codec, with the receiver and
its senders in this process (the real stream on loopback; gRPC clients driven by hand where a test must
hold a transfer in place)."""
from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass

import grpc
import pytest

from kv_transfer import (KVTransferError, ReceiverAddress, SendRequest, TransferConfig, TransferStatus, create_receiver,
                         create_sender)
from kv_transfer.grpc.admission import AdmissionQueue
from kv_transfer.grpc.codec import PUSH_PATH, chunk_parts, decode_chunk, encode_data_chunk, encode_manifest_chunk
from kv_transfer.grpc.heap import keep_heap_for_messages
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.results import ReceiveFailed, ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, fill_blocks
from proto import tandem_pb2
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import FP32, SENDER_BLOCKS, Start

TIMEOUT_S = 20.0

QUEUE_LIMIT, QUEUE_SIZE = 1, 2


@dataclass
class Local:
    """A gRPC receiver admitting 1 transfer with a queue of 2, and an in-process sender."""

    side: sc.Side
    pool: FreeListPool  # the sender's pool
    sender: object


@pytest.fixture
def local():
    config = TransferConfig(transport="grpc", kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=30,
                            grpc_max_concurrent_transfers=QUEUE_LIMIT, grpc_max_queued_transfers=QUEUE_SIZE)
    pool = sc.receiver_pool(FP32)
    gate = sc.Gate(pool)
    side = sc.Side("float32", pool, gate, create_receiver(config, gate.view(), "grpc", host="127.0.0.1", port=0))
    sender_pool = FreeListPool(FP32, SENDER_BLOCKS)
    sender = create_sender(config, sender_pool.view(), "grpc")
    yield Local(side, sender_pool, sender)
    sender.close()
    side.receiver.close()
    assert sender_pool.num_free == SENDER_BLOCKS, "the sender leaks blocks"
    assert pool.num_free == sc.RECEIVER_BLOCKS, "the receiver leaks blocks"


def _start(key: str, blocks, seed: int) -> Start:
    return Start(key, "float32", ReceiverAddress("grpc"), tuple(blocks), len(blocks) * FP32.block_size, seed)


def _send(local: Local, start: Start):
    local.pool.take(start.block_ids)
    fill_blocks(local.pool.kv, start.block_ids, start.seed)
    request = SendRequest(start.key, start.block_ids, start.num_tokens, first_token=start.seed)
    return local.sender.send(local.side.receiver.address, request)


def _eventually(condition, what: str) -> None:
    """Waits for a condition of the receiver's state (a generous bound, not a timing assertion)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


class HeldPush:
    """A hand-driven Push: sends the manifest, is accepted (blocks allocated, the slot taken), then holds
    until release() streams the data and returns the final ack."""

    def __init__(self, local: Local, start: Start):
        local.pool.take(start.block_ids)
        fill_blocks(local.pool.kv, start.block_ids, start.seed)
        request = SendRequest(start.key, start.block_ids, start.num_tokens, first_token=start.seed)
        self.outgoing = prepare_outgoing(local.pool.view(), request, StagingPool("cpu"))
        self.outgoing.gather_all()
        self.local, self.block_ids = local, start.block_ids
        self.writes: queue.SimpleQueue = queue.SimpleQueue()
        self.channel = grpc.insecure_channel(local.side.receiver.address.target)
        push = self.channel.stream_stream(PUSH_PATH, request_serializer=None,
                                          response_deserializer=tandem_pb2.KVAck.FromString)
        self.writes.put(encode_manifest_chunk(self.outgoing.manifest_bytes))
        self.acks = push(iter(self.writes.get, None), timeout=60)
        self.verdict = next(self.acks)

    def release(self) -> tandem_pb2.KVAck:
        for payload in self.outgoing.run_payloads:
            self.writes.put(encode_data_chunk(memoryview(payload.numpy())))
        self.writes.put(None)
        final = next(self.acks)
        for _ in self.acks:  # to the call's status: the receiver delivers once its ack's write completed, and
            pass  # closing the channel before that cancelled the write (A ended PEER_FAILED on a busy machine)
        self.channel.close()
        self.local.pool.free(self.block_ids)
        return final


def _outcomes(side: sc.Side, count: int) -> dict:
    outcomes = [side.receiver.wait(30) for _ in range(count)]
    return {getattr(o, "request_id", None): o for o in outcomes}


def test_transfers_past_the_limit_wait_in_the_queue(local):
    """A holds the only slot; B and E queue, E's sender gives up (it leaves the queue), D queues and is
    cancelled by the receiver while it waits, C finds the queue full. Then A finishes, B is admitted and
    delivered bit for bit, D ends CANCELLED when its turn comes; every block is freed on both sides."""
    receiver, admission = local.side.receiver, local.side.receiver.admission
    a, b, c, d, e = (_start(k, range(8 * i, 8 * i + 6), seed=20 + i) for i, k in enumerate("ABCDE"))
    held = HeldPush(local, a)
    assert held.verdict.status == tandem_pb2.KV_OK and not held.verdict.final
    assert admission.active == 1 and admission.queued == 0
    b_handle = _send(local, b)
    _eventually(lambda: admission.queued == 1, "B queued")
    e_handle = _send(local, e)
    _eventually(lambda: admission.queued == 2, "E queued")
    e_handle.cancel()
    assert e_handle.exception(30).status == TransferStatus.CANCELLED
    _eventually(lambda: admission.queued == 1, "E left the queue")
    d_handle = _send(local, d)
    _eventually(lambda: admission.queued == 2, "D queued")
    receiver.cancel(d.key)
    c_handle = _send(local, c)
    assert c_handle.exception(30).status == TransferStatus.REJECTED_BUSY
    assert local.side.pool.num_free == sc.RECEIVER_BLOCKS - 6, "only A holds receiver blocks"
    final = held.release()
    assert final.status == tandem_pb2.KV_OK and final.final, final
    b_handle.result(30)
    assert d_handle.exception(30).status == TransferStatus.CANCELLED
    got = _outcomes(local.side, 5)
    sc.check_received(local.side, got["A"], a)
    sc.check_received(local.side, got["B"], b)
    assert {k: got[k].status for k in "CDE"} == {"C": TransferStatus.REJECTED_BUSY, "D": TransferStatus.CANCELLED,
                                                 "E": TransferStatus.PEER_FAILED}
    assert admission.active == 0 and admission.queued == 0
    assert receiver.inbox.num_cancels == 0


def test_cancel_memory_expires():
    now = [0.0]
    inbox = ReceiveInbox(cancel_ttl_s=10.0, max_cancels=3, clock=lambda: now[0])
    inbox.cancel("a")
    now[0] = 5.0
    inbox.cancel("b")
    assert inbox.is_cancelled("a") and inbox.is_cancelled("b") and inbox.num_cancels == 2
    now[0] = 10.0
    assert not inbox.is_cancelled("a") and inbox.is_cancelled("b") and inbox.num_cancels == 1
    inbox.cancel("b")  # renewed until 20
    now[0] = 19.0
    assert inbox.is_cancelled("b")
    for key in "cdef":
        inbox.cancel(key)
    assert inbox.num_cancels == 3 and not inbox.is_cancelled("b") and not inbox.is_cancelled("c")
    inbox.put(ReceiveFailed("d", TransferStatus.CANCELLED, "consumed"))
    assert not inbox.is_cancelled("d") and inbox.num_cancels == 2
    now[0] = 1e6
    assert inbox.num_cancels == 0


def test_receiver_forgets_an_expired_cancel(local):
    """A cancelled id arriving within the TTL is refused; once the TTL has passed it is accepted."""
    now = [0.0]
    local.side.receiver.inbox = ReceiveInbox(cancel_ttl_s=60.0, clock=lambda: now[0])
    early, late = _start("early", (1, 2, 3), seed=60), _start("late", (4, 5), seed=61)
    local.side.receiver.cancel(early.key)
    local.side.receiver.cancel(late.key)
    assert _send(local, early).exception(30).status == TransferStatus.CANCELLED
    sc.take_failure(local.side, "CANCELLED")
    now[0] = 61.0
    _send(local, late).result(30)
    sc.take_received(local.side, late)
    assert local.side.receiver.inbox.num_cancels == 0


def test_chunks_span_planes_and_encode_like_protobuf():
    pieces = [memoryview(bytes(range(i, i + n))) for i, n in ((0, 5), (50, 3), (100, 9))]
    chunks = list(chunk_parts(pieces, 4))
    assert [sum(p.nbytes for p in parts) for parts in chunks] == [4, 4, 4, 4, 1]
    joined = b"".join(bytes(p) for parts in chunks for p in parts)
    assert joined == b"".join(bytes(p) for p in pieces)
    wire = encode_data_chunk(chunks[1])
    assert wire == tandem_pb2.KVChunk(data=bytes(pieces[0][4:]) + bytes(pieces[1][:3])).SerializeToString()
    assert bytes(decode_chunk(wire).data) == bytes(pieces[0][4:]) + bytes(pieces[1][:3])


def test_heap_thresholds_only_rise():
    assert keep_heap_for_messages(1 << 20)  # glibc (the dev box and the images)
    assert keep_heap_for_messages(1 << 10)  # already covered: nothing to lower


def test_admission_queue_is_fifo_bounded_and_times_out():
    async def scenario():
        queue_ = AdmissionQueue(limit=1, max_queued=2)
        order: list[str] = []

        async def transfer(name: str, timeout_s: float = 30.0) -> None:
            await queue_.enter(timeout_s, name)
            order.append(name)

        await queue_.enter(30.0, "first")  # takes the only slot
        waiters = [asyncio.ensure_future(transfer(name)) for name in ("second", "third")]
        await asyncio.sleep(0)
        assert (queue_.active, queue_.queued) == (1, 2)
        with pytest.raises(KVTransferError) as busy:
            await queue_.enter(30.0, "fourth")
        assert busy.value.status == TransferStatus.REJECTED_BUSY
        waiters[1].cancel()  # "third" gives up: it leaves the queue holding nothing
        await asyncio.wait([waiters[1]])
        assert queue_.queued == 1
        with pytest.raises(KVTransferError) as late:
            await queue_.enter(0.01, "impatient")  # queued behind "second", no slot comes
        assert late.value.status == TransferStatus.TIMEOUT and queue_.queued == 1
        queue_.leave()  # "first" ends: the slot passes straight to "second"
        await waiters[0]
        assert order == ["second"] and (queue_.active, queue_.queued) == (1, 0)
        queue_.leave()
        assert queue_.active == 0

    asyncio.run(scenario())


def test_outcomes_forwarded_to_a_sink_skip_the_queue():
    """deliver_to / forward_to: what was queued goes to the sink at once, later outcomes on the putting
    thread; a cancel is still consumed by its outcome, and nothing is left for poll()."""
    inbox, got = ReceiveInbox(), []
    inbox.put(ReceiveFailed("early", TransferStatus.TIMEOUT, "queued before"))
    inbox.cancel("late")
    inbox.forward_to(got.append)
    assert [o.request_id for o in got] == ["early"]
    inbox.put(ReceiveFailed("late", TransferStatus.CANCELLED, "after"))
    assert [o.request_id for o in got] == ["early", "late"]
    assert not inbox.is_cancelled("late") and inbox.poll() == []
