"""A gloo pair survives a transfer that runs past its timeout: that transfer fails (both ends free its
blocks, also when the receiver had allocated them and could no longer accept), both ends open the pair's next epoch (a new two-rank process group), and the next transfers on
the same pair arrive bit for bit. Sender and receiver run in this process, on threads, over real gloo."""
from __future__ import annotations

import threading

import pytest

from kv_transfer import (DistRendezvous, ReceivedKV, ReceiveFailed, ReceiverAddress, SendRequest, TransferConfig,
                         create_receiver, create_sender)
from kv_transfer.pool import KVPoolView
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_peer import FP32

TIMEOUT_S = 1.0
BLOCKS = 32


class StallingPool:
    """A receiver pool whose allocate can be held shut: a receiver that is slow to take a transfer."""

    def __init__(self, pool: FreeListPool) -> None:
        self.pool, self.open = pool, threading.Event()
        self.open.set()

    def allocate(self, n: int) -> list[int] | None:
        self.open.wait(30)
        return self.pool.allocate(n)

    def view(self) -> KVPoolView:
        return KVPoolView(self.pool.kv, self.allocate, self.pool.free)


@pytest.fixture
def pair():
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=10)
    sender_pool, receiver_pool = FreeListPool(FP32, BLOCKS), StallingPool(FreeListPool(FP32, BLOCKS))
    receiver = create_receiver(config, receiver_pool.view(), "gloo", DistRendezvous(1, 2, "pr"),
                               peers=[0])
    sender = create_sender(config, sender_pool.view(), "gloo", DistRendezvous(0, 2, "pr"))
    yield sender, sender_pool, receiver, receiver_pool
    sender.close()
    receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.pool.num_free == BLOCKS


def send(sender, sender_pool: FreeListPool, request_id: str, seed: int, to: ReceiverAddress):
    blocks = sender_pool.allocate(3)
    fill_blocks(sender_pool.kv, blocks, seed)
    expected = blocks_bytes(sender_pool.kv, blocks)
    handle = sender.send(to, SendRequest(request_id, tuple(blocks), 10, 7))
    return handle, expected


def test_a_timed_out_transfer_fails_only_itself(pair):
    sender, sender_pool, receiver, receiver_pool = pair
    receiver_pool.open.clear()                       # the receiver takes longer than the timeout
    slow, _ = send(sender, sender_pool, "slow", seed=1, to=receiver.address)
    with pytest.raises(Exception):
        slow.future.result(10)
    receiver_pool.open.set()
    failed = receiver.wait(10)
    assert isinstance(failed, ReceiveFailed) and failed.request_id == "slow", failed  # its blocks freed
    for i in range(3):                               # the pair is rebuilt, not broken for good
        handle, expected = send(sender, sender_pool, f"after-{i}", seed=10 + i, to=receiver.address)
        handle.future.result(20)
        got = receiver.wait(20)
        assert isinstance(got, ReceivedKV) and got.request_id == f"after-{i}", got
        assert blocks_bytes(receiver_pool.pool.kv, got.block_ids) == expected
        receiver_pool.pool.free(got.block_ids)
