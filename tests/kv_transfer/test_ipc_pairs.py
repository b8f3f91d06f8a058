"""Transport 'ipc' beyond the shared scenarios: how it is chosen and refused, which pool handles a receiver
maps, a pair that recovers from a timed-out transfer (the pool is published again on the new channel), and a
receiving process that dies mid-transfer. CPU pools in shared memory (test_ipc.py runs the CUDA path)."""
from __future__ import annotations

import pickle
import threading

import pytest
import torch

from kv_transfer import (DistRendezvous, KVPoolView, KVTransferError, ReceivedKV, ReceiveFailed, SendRequest,
                         TransferConfig, TransferStatus, create_receiver, create_sender, resolve_transport)
from kv_transfer.ipc.pool_handle import PoolHandleError, export_pool, import_pool
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from tests.support.kv_peer import FP32
from tests.support.kv_receiver_peer import SENDER_RANK, ReceiverProcess, ReceiverSpec, rendezvous

BLOCKS = 32


def test_auto_picks_ipc_on_one_gpu_and_explicit_ipc_is_checked():
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert resolve_transport("auto", cuda0, cuda0) == "ipc"
    assert resolve_transport("ipc", cuda0, cuda0) == "ipc"
    assert resolve_transport("auto", cuda0, cuda0, same_host=False) == "nccl"
    assert resolve_transport("auto", cuda0, cuda1) == "nccl"
    for sender, receiver, same_host, where in [(cuda0, cuda1, True, "cuda:0 and cuda:1"),
                                               (cpu, cpu, True, "cpu and cpu"),
                                               (cuda0, cuda0, False, "different hosts")]:
        with pytest.raises(ValueError, match=f"same CUDA device of one host, they are (on )?{where}"):
            resolve_transport("ipc", sender, receiver, same_host=same_host)


def test_a_cpu_pool_outside_shared_memory_is_refused():
    config = TransferConfig(transport="ipc")
    rdzv = DistRendezvous(0, 2, "never-used")
    with pytest.raises(ValueError, match="shared memory"):
        create_sender(config, FreeListPool(FP32, 4).view(), "ipc", rdzv)
    with pytest.raises(ValueError, match="needs a DistRendezvous"):
        create_receiver(config, FreeListPool(FP32, 4).view(), "ipc")


def test_pool_handles_map_only_kv_pools():
    pool = FreeListPool(FP32, 4)
    pool.kv.share_memory_()
    mapped = import_pool(export_pool(pool.kv), torch.device("cpu"))
    assert mapped.data_ptr() == pool.kv.data_ptr() and mapped.shape == pool.kv.shape  # the same memory
    with pytest.raises(PoolHandleError, match="may not refer to posix.system"):
        import_pool(pickle.dumps((__import__("os").system, ("false",))), torch.device("cpu"))
    with pytest.raises(PoolHandleError, match="does not describe a KV pool"):
        import_pool(export_pool(pool.kv[0].clone().share_memory_()), torch.device("cpu"))
    with pytest.raises(PoolHandleError, match="could not map"):
        import_pool(b"\x80\x05truncated", torch.device("cpu"))
    with pytest.raises(PoolHandleError, match="longer than"):
        import_pool(bytes(1 << 20), torch.device("cpu"))
    with pytest.raises(PoolHandleError, match="is on cpu, this pool on cuda:0"):
        import_pool(export_pool(pool.kv), torch.device("cuda", 0))


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


def _deliver(sender, receiver, sender_pool: FreeListPool, receiver_pool: StallingPool, key: str, seed: int) -> None:
    """One transfer of 5 blocks, checked bit for bit on arrival; the receiver's blocks are freed after."""
    blocks = sender_pool.allocate(5)
    fill_blocks(sender_pool.kv, blocks, seed=seed)
    expected = blocks_bytes(sender_pool.kv, blocks)
    sender.send(receiver.address, SendRequest(key, tuple(blocks), 17, 7)).result(20)
    got = receiver.wait(20)
    assert isinstance(got, ReceivedKV) and got.request_id == key, got
    assert blocks_bytes(receiver_pool.pool.kv, got.block_ids) == expected
    receiver_pool.pool.free(got.block_ids)


def test_a_timed_out_transfer_fails_only_itself():
    """Sender and receiver in this process, on threads, their pair connected and the pool mapped by a first
    transfer (so the 1 s timeout is all the receiver's stall, however loaded the machine): the slow transfer
    times out (both ends free its blocks), both ends open the pair's next channel, the pool is published and
    mapped again, and the next transfers arrive bit for bit."""
    config = TransferConfig(transport="ipc", kv_transfer_timeout_s=1.0, connect_timeout_s=10)
    sender_pool, receiver_pool = FreeListPool(FP32, BLOCKS), StallingPool(FreeListPool(FP32, BLOCKS))
    sender_pool.kv.share_memory_()
    receiver = create_receiver(config, receiver_pool.view(), "ipc", DistRendezvous(1, 2, "pr"),
                               peers=[0])
    sender = create_sender(config, sender_pool.view(), "ipc", DistRendezvous(0, 2, "pr"))
    try:
        _deliver(sender, receiver, sender_pool, receiver_pool, "first", seed=9)
        receiver_pool.open.clear()  # the receiver takes longer than the timeout
        slow = sender.send(receiver.address, SendRequest("slow", tuple(sender_pool.allocate(3)), 10, 7))
        with pytest.raises(KVTransferError):
            slow.result(10)
        receiver_pool.open.set()
        failed = receiver.wait(10)
        assert isinstance(failed, ReceiveFailed) and failed.request_id == "slow", failed
        for i in range(3):
            _deliver(sender, receiver, sender_pool, receiver_pool, f"after-{i}", seed=10 + i)
    finally:
        sender.close()
        receiver.close()
    assert sender_pool.num_free == BLOCKS and receiver_pool.pool.num_free == BLOCKS


def test_receiver_killed_mid_transfer():
    """The receiving process is killed inside allocate (it has mapped the pool and read the manifest): the
    sender fails PEER_FAILED long before its 120 s timeout and frees every block."""
    spec = ReceiverSpec("ipc", namespace="ipc-receiver-death")
    receiver = ReceiverProcess(spec)
    pool = FreeListPool(FP32, BLOCKS)
    pool.kv.share_memory_()
    config = TransferConfig(transport="ipc", kv_transfer_timeout_s=120, connect_timeout_s=30)
    sender = create_sender(config, pool.view(), "ipc", rendezvous=rendezvous(spec, SENDER_RANK))
    try:
        block_ids = tuple(range(4, 20))
        pool.take(block_ids)
        fill_blocks(pool.kv, block_ids, seed=3)
        handle = sender.send(receiver.address, SendRequest("doomed", block_ids, len(block_ids) * FP32.block_size, 7))
        receiver.wait_allocating()
        receiver.kill()
        with pytest.raises(KVTransferError) as err:
            handle.result(timeout=30)
        assert err.value.status == TransferStatus.PEER_FAILED, err.value
        assert pool.num_free == BLOCKS
    finally:
        receiver.kill()
        sender.close()

