"""A request's KV heads between groups of different layouts (kv_transfer/lanes/parts.py): the plan gives every
receiving rank each of its heads once; over real gloo (group and inline) and gRPC a wider sending side's parts merge
into one receiving pool (PartAssembler), and a narrower sending side splits its pool's heads over two (head windows
of a pool), whole or layer-streamed, bit-exact. Every block is free at the end."""
from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
import torch

from kv_transfer import DistRendezvous, ReceivedKV, SendRequest, TransferConfig, create_receiver, create_sender
from kv_transfer.lanes.assembly import PartAssembler
from kv_transfer.lanes.parts import LanePart, plan_parts
from kv_transfer.layer_stream import LayerClock, LayerStream, StreamTail
from kv_transfer.manifest import ModelFingerprint
from kv_transfer.pool import KVPoolView
from kv_transfer.testing import FreeListPool, fill_blocks

FP = ModelFingerprint(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float32", block_size=4)
NUM_BLOCKS = 24
BLOCKS = (2, 3, 7, 11)  # two runs
HEADS = (0, 4)


@pytest.mark.parametrize("senders, receivers, expected", [
    ([(0, 2), (2, 4)], [(0, 2), (2, 4)], [(0, 0, (0, 2)), (1, 1, (2, 4))]),  # one layout: rank i to rank i
    ([(0, 2), (2, 4)], [(0, 4)], [(0, 0, (0, 2)), (1, 0, (2, 4))]),  # merge
    ([(0, 4)], [(0, 2), (2, 4)], [(0, 0, (0, 2)), (0, 1, (2, 4))]),  # split
    ([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 2), (2, 4)],
     [(0, 0, (0, 1)), (1, 0, (1, 2)), (2, 1, (2, 3)), (3, 1, (3, 4))]),
    ([(0, 1), (0, 1), (1, 2), (1, 2)], [(0, 2)], [(0, 0, (0, 1)), (2, 0, (1, 2))]),  # replicated senders
    ([(0, 1), (0, 1), (1, 2), (1, 2)], [(0, 1), (0, 1), (1, 2), (1, 2)],
     [(0, 0, (0, 1)), (1, 1, (0, 1)), (2, 2, (1, 2)), (3, 3, (1, 2))]),
    ([(0, 1), (1, 2)], [(0, 1), (0, 1), (1, 2), (1, 2)],  # replicated receivers
     [(0, 0, (0, 1)), (0, 1, (0, 1)), (1, 2, (1, 2)), (1, 3, (1, 2))]),
    ([(0, 1), (0, 1)], [(0, 1), (0, 1), (0, 1)], [(0, 0, (0, 1)), (1, 1, (0, 1)), (0, 2, (0, 1))]),  # spread
])
def test_the_plan_gives_every_receiving_rank_each_of_its_heads_once(senders, receivers, expected):
    parts = plan_parts(senders, receivers)
    assert parts == tuple(LanePart(*part) for part in expected)
    for receiver, (start, stop) in enumerate(receivers):
        mine = sorted(part.heads for part in parts if part.receiver == receiver)
        assert sum(b - a for a, b in mine) == stop - start and mine[0][0] == start and mine[-1][1] == stop
    for part in parts:
        assert senders[part.sender][0] <= part.heads[0] < part.heads[1] <= senders[part.sender][1]


def test_a_head_no_sending_rank_holds_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="KV head 4 of receiving rank 1 is held by no sending rank"):
        plan_parts([(0, 4)], [(0, 4), (4, 8)])


def test_a_head_window_is_a_view_of_the_same_blocks_and_only_within_the_pool():
    pool = FreeListPool(FP, 4)
    view = KVPoolView(pool.kv, pool.allocate, pool.free, kv_heads=(4, 8))
    window = view.head_window((5, 7))  # [L, 2, N, bs, 2, D]
    assert window.shape[4] == 2 and window.data_ptr() == pool.kv[:, :, :, :, 1].data_ptr()
    with pytest.raises(ValueError, match="not within the pool's"):
        view.head_window((3, 5))
    strided = KVPoolView(window, pool.allocate, pool.free, kv_heads=(5, 7))
    assert not strided.contiguous and view.contiguous
    with pytest.raises(ValueError, match="only a contiguous host pool"):
        strided.host_planes(0, 1)
    with pytest.raises(ValueError, match="must be contiguous"):
        KVPoolView(window, pool.allocate, pool.free)  # a window says which heads it holds


def layout(heads: tuple[int, int]) -> ModelFingerprint:
    return dataclasses.replace(FP, num_kv_heads=heads[1] - heads[0])


def transfer_config(path: str) -> TransferConfig:
    transport, _, way = path.partition("-")
    return TransferConfig(transport=transport, kv_transfer_timeout_s=20, connect_timeout_s=30, dist_lanes=1,
                          inline_max_bytes=0 if way == "group" else TransferConfig.inline_max_bytes)


class Receiving:
    """A receiving rank holding KV heads `heads`: its pool behind a PartAssembler and a real receiver (rank `rank` of
    the rendezvous, listening to `senders`); its outcomes and released blocks collected."""

    def __init__(self, config: TransferConfig, heads: tuple[int, int], rendezvous: DistRendezvous | None,
                 senders: list[int], device: str = "cpu") -> None:
        self.pool = FreeListPool(layout(heads), NUM_BLOCKS, device, free_order=list(reversed(range(NUM_BLOCKS))))
        self.outcomes: list = []
        self.released: list[list[int]] = []
        self.parts = PartAssembler(self.pool.kv, heads, lambda rid, n: self.pool.allocate(n), self.outcomes.append,
                                   self._release)
        self.receiver = create_receiver(config, self.parts.pool, config.transport, rendezvous, peers=senders)
        self.receiver.deliver_to(self.parts.outcome)

    def _release(self, block_ids) -> None:
        self.released.append(list(block_ids))
        self.pool.free(block_ids)

    def wait(self, count: int = 1, timeout_s: float = 20.0) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.outcomes)


def rendezvous_of(config: TransferConfig, world: int):
    namespace = f"parts-{uuid.uuid4().hex[:8]}"
    return lambda rank: None if config.transport == "grpc" else DistRendezvous(rank, world, namespace)


def send_parts(request: SendRequest, senders: list, receiving: list[Receiving], stream: bool, device: str) -> None:
    """Each sender ships its part of request to its receiving rank (whole, or layer-streamed: the forward's side
    writes each layer, then hands the first token and the blocks over); returns once every part was acknowledged."""
    clock = LayerClock(FP.num_layers, torch.device(device))
    parts = [dataclasses.replace(request, first_token=None, stream=LayerStream(clock)) if stream else request
             for _ in senders]
    handles = [sender.send(rank.receiver.address, part) for sender, rank, part in zip(senders, receiving, parts)]
    if stream:
        for layer in range(FP.num_layers):
            time.sleep(0.005)
            clock.layer_done(layer)
        for part in parts:
            part.stream.finish(StreamTail(request.first_token), request.block_ids)
    for handle in handles:
        handle.result(20)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["gloo-inline", "gloo-group", "grpc"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_wider_sending_side_merges_its_parts_into_one_pool_bit_exact(path, stream, device):
    """On a GPU: CUDA pools, the parts staged through pinned host memory, landing in a strided CUDA view."""
    config = transfer_config(path)
    rendezvous = rendezvous_of(config, 3)
    receiving = Receiving(config, HEADS, rendezvous(0), [1, 2], device)
    senders, pools = [], []
    for rank, heads in ((1, (0, 2)), (2, (2, 4))):
        pool = FreeListPool(layout(heads), NUM_BLOCKS, device)
        pool.take(BLOCKS)
        fill_blocks(pool.kv, BLOCKS, seed=rank)
        pools.append(pool)
        senders.append(create_sender(config, keep_view(pool, heads), config.transport, rendezvous(rank)))
    try:
        send_parts(SendRequest("merged", BLOCKS, 15, 7), senders, [receiving] * 2, stream, device)
        (outcome,) = receiving.wait()
        assert isinstance(outcome, ReceivedKV) and outcome.manifest.first_token == 7
        assert outcome.kv_bytes == 2 * len(BLOCKS) * pools[0].kv[:, :, 0].nbytes
        landed = receiving.pool.kv[:, :, list(outcome.block_ids)]  # [L, 2, n, bs, 4, D]
        expected = torch.cat([pool.kv[:, :, list(BLOCKS)] for pool in pools], dim=4)
        assert torch.equal(landed, expected)
        receiving.pool.free(outcome.block_ids)
        assert receiving.wait(2, timeout_s=0.3) == [outcome] and not receiving.released
    finally:
        for sender in senders:
            sender.close()
        receiving.receiver.close()
    assert receiving.pool.num_free == NUM_BLOCKS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["gloo-inline", "gloo-group", "grpc"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_narrower_sending_side_splits_its_heads_over_two_pools_bit_exact(path, stream, device):
    """On a GPU: a strided CUDA view gathered into pinned host staging, layer by layer when streamed."""
    config = transfer_config(path)
    rendezvous = rendezvous_of(config, 3)
    receiving = [Receiving(config, heads, rendezvous(rank), [2], device)
                 for rank, heads in ((0, (0, 2)), (1, (2, 4)))]
    pool = FreeListPool(FP, NUM_BLOCKS, device)
    pool.take(BLOCKS)
    fill_blocks(pool.kv, BLOCKS, seed=5)
    whole = keep_view(pool, HEADS)
    senders = [create_sender(config, KVPoolView(whole.head_window(heads), refuse_allocation, keep_blocks,
                                                kv_heads=heads), config.transport, rendezvous(2))
               for heads in ((0, 2), (2, 4))]
    try:
        send_parts(SendRequest("split", BLOCKS, 15, 9), senders, receiving, stream, device)
        for rank, (start, stop) in zip(receiving, ((0, 2), (2, 4))):
            (outcome,) = rank.wait()
            assert isinstance(outcome, ReceivedKV) and outcome.manifest.kv_heads == (start, stop)
            landed = rank.pool.kv[:, :, list(outcome.block_ids)]
            assert torch.equal(landed, pool.kv[:, :, list(BLOCKS), :, start:stop])
            rank.pool.free(outcome.block_ids)
    finally:
        for sender in senders:
            sender.close()
        for rank in receiving:
            rank.receiver.close()
    assert all(rank.pool.num_free == NUM_BLOCKS for rank in receiving)


def refuse_allocation(num_blocks: int) -> None:
    return None


def keep_blocks(block_ids) -> None:
    """The test owns the sending blocks."""


def keep_view(pool: FreeListPool, heads: tuple[int, int]) -> KVPoolView:
    return KVPoolView(pool.kv, refuse_allocation, keep_blocks, kv_heads=heads)
