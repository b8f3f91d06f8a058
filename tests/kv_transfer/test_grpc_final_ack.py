"""The receiver's one ack per transfer, on a session stream, when it fails or is late. A receiver delivers only
once its final ack went out to gRPC; an ack that cannot go out frees the blocks and reports PEER_FAILED, and
the sender, which then sees its stream end without an ack, fails the transfer too. A sender cancelled while it
waits for the ack settles CANCELLED at once. Both pools end whole and the next transfer is delivered bit for
bit on a fresh stream. Each failure is injected at that exact point (`GrpcReceiver._write_final`)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kv_transfer import (KVTransferError, ReceivedKV, ReceiveFailed, SendRequest, TransferConfig, TransferStatus,
                         create_receiver, create_sender)
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_peer import FP32

BLOCKS = 32


@pytest.fixture
def pair():
    config = TransferConfig(transport="grpc", kv_transfer_timeout_s=10)
    sender_pool, receiver_pool = FreeListPool(FP32, BLOCKS), FreeListPool(FP32, BLOCKS)
    receiver = create_receiver(config, receiver_pool.view(), "grpc")
    sender = create_sender(config, sender_pool.view(), "grpc")
    yield sender, sender_pool, receiver, receiver_pool
    sender.close()
    receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.num_free == BLOCKS, "a KV block leaked"


def _send(sender, pool: FreeListPool, receiver, request_id: str, seed: int):
    blocks = pool.allocate(6)
    fill_blocks(pool.kv, blocks, seed)
    expected = blocks_bytes(pool.kv, blocks)
    return sender.send(receiver.address, SendRequest(request_id, tuple(blocks), 6 * FP32.block_size, 7)), expected


def _delivered_on_a_fresh_stream(sender, sender_pool, receiver, receiver_pool, request_id: str) -> None:
    opened = sender.streams.counts["streams_opened"]
    handle, expected = _send(sender, sender_pool, receiver, request_id, seed=9)
    handle.result(20)
    got = receiver.wait(20)
    assert isinstance(got, ReceivedKV) and blocks_bytes(receiver_pool.kv, got.block_ids) == expected
    receiver_pool.free(got.block_ids)
    assert sender.streams.counts["streams_opened"] == opened + 1


def test_a_final_ack_that_cannot_go_out_fails_on_both_sides(pair, monkeypatch):
    sender, sender_pool, receiver, receiver_pool = pair
    handle, _ = _send(sender, sender_pool, receiver, "warm", seed=1)
    handle.result(20)
    receiver_pool.free(receiver.wait(20).block_ids)

    async def refused(context, final):
        raise RuntimeError("injected: the final ack could not be written")

    monkeypatch.setattr(receiver, "_write_final", refused)
    handle, _ = _send(sender, sender_pool, receiver, "A", seed=2)
    with pytest.raises(KVTransferError) as failed:
        handle.result(20)
    assert failed.value.status == TransferStatus.PEER_FAILED, failed.value
    outcome = receiver.wait(20)
    assert isinstance(outcome, ReceiveFailed) and outcome.request_id == "A", outcome
    assert "could not ack" in outcome.message and receiver_pool.num_free == BLOCKS
    assert sender_pool.num_free == BLOCKS
    monkeypatch.undo()
    _delivered_on_a_fresh_stream(sender, sender_pool, receiver, receiver_pool, "B")


def test_a_cancel_while_the_sender_waits_for_its_ack_settles_at_once(pair, monkeypatch):
    """The receiver's ack is late (held 2 s) and the sender cancels meanwhile: the handle settles CANCELLED at
    once and the sender's blocks are freed; the receiver, whose stream the cancel ended, frees and reports
    PEER_FAILED; the pair delivers the next transfer."""
    sender, sender_pool, receiver, receiver_pool = pair
    write_final = receiver._write_final
    holding = threading.Event()

    async def late(context, final):
        holding.set()
        await asyncio.sleep(2)
        await write_final(context, final)

    monkeypatch.setattr(receiver, "_write_final", late)
    handle, _ = _send(sender, sender_pool, receiver, "C", seed=3)
    assert holding.wait(20)
    began = time.monotonic()
    handle.cancel()
    with pytest.raises(KVTransferError) as failed:
        handle.result(5)
    assert failed.value.status == TransferStatus.CANCELLED, failed.value
    assert time.monotonic() - began < 1.5, "the cancel waited for the late ack"
    assert sender_pool.num_free == BLOCKS
    outcome = receiver.wait(20)
    assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.PEER_FAILED, outcome
    assert receiver_pool.num_free == BLOCKS
    monkeypatch.undo()
    _delivered_on_a_fresh_stream(sender, sender_pool, receiver, receiver_pool, "D")
