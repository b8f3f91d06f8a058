"""A receiving rank's PartAssembler (kv_transfer/lanes/assembly.py), driven as a receiver drives it: a request's parts
deliver it once when they cover its heads, an overlapping or late part is refused without ending it, a failed or
forgotten request frees its blocks once no part can write them, a second part waits for the first to take the
blocks; and a gRPC receiver whose allocation waits (a lane follower's, for rank 0's Expect) serves its other transfers
meanwhile. Every block is free at the end."""
from __future__ import annotations

import threading
import time

import torch

from kv_transfer import ReceivedKV, ReceiveFailed, SendRequest, create_receiver, create_sender
from kv_transfer.lanes.assembly import PartAssembler
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.staging import StagingPool
from kv_transfer.status import TransferStatus
from kv_transfer.testing import FreeListPool, fill_blocks
from tests.kv_transfer.test_lane_parts import (BLOCKS, FP, HEADS, NUM_BLOCKS, keep_blocks, keep_view, layout,
                                               refuse_allocation, transfer_config)


class Parts:
    """A PartAssembler of heads (0, 4) over a plain pool, driven as a receiver drives it: parts take blocks through
    the pool (or its windows), then their outcomes come."""

    def __init__(self) -> None:
        self.pool = FreeListPool(FP, NUM_BLOCKS)
        self.outcomes: list = []
        self.released: list[list[int]] = []
        self.assembler = PartAssembler(self.pool.kv, HEADS, lambda rid, n: self.pool.allocate(n),
                                       self.outcomes.append, self._release, failed_ttl_s=60)

    def _release(self, block_ids) -> None:
        self.released.append(list(block_ids))
        self.pool.free(block_ids)

    def view(self, heads: tuple[int, int]) -> KVPoolView:
        return self.assembler.pool if heads == HEADS else self.assembler.pool.windows(heads)

    def take(self, request_id: str, heads: tuple[int, int], num_blocks: int = 2) -> list[int] | None:
        return self.view(heads).allocate_incoming(request_id, num_blocks)

    def landed(self, request_id: str, heads: tuple[int, int], blocks: list[int]) -> None:
        manifest = prepare_outgoing(keep_view(FreeListPool(layout(heads), NUM_BLOCKS), heads),
                                    SendRequest(request_id, tuple(blocks), 2 * FP.block_size, 3),
                                    StagingPool("cpu")).manifest
        self.assembler.outcome(ReceivedKV(manifest, tuple(blocks), 100, 0.0))

    def failed(self, request_id: str, heads: tuple[int, int], blocks: list[int] | None,
               status: TransferStatus = TransferStatus.CHECKSUM_MISMATCH) -> None:
        """A part's failure: the transport frees what it took, then reports."""
        if blocks is not None:
            self.view(heads).free(blocks)
        self.assembler.outcome(ReceiveFailed(request_id, status, "a part failed"))


def test_parts_deliver_once_when_their_heads_are_covered_and_overlaps_are_refused_without_ending_it():
    parts = Parts()
    first = parts.take("r", (0, 1))
    assert parts.take("r", (0, 2)) is None  # overlaps head 0: refused, blocks untouched
    parts.failed("r", (0, 2), None, TransferStatus.REJECTED_NO_BLOCKS)  # its refusal is not the request's end
    assert parts.take("r", (1, 4)) == first and parts.take("r", (1, 4), num_blocks=3) is None
    parts.failed("r", (1, 4), None, TransferStatus.REJECTED_NO_BLOCKS)
    parts.landed("r", (1, 4), first)
    assert parts.outcomes == []
    parts.landed("r", (0, 1), first)
    (outcome,) = parts.outcomes
    assert isinstance(outcome, ReceivedKV) and list(outcome.block_ids) == first and outcome.kv_bytes == 200
    parts.pool.free(first)
    assert parts.pool.num_free == NUM_BLOCKS and not parts.released


def test_a_failed_part_ends_the_request_once_the_others_under_way_end_and_late_parts_are_refused():
    parts = Parts()
    blocks = parts.take("r", (0, 2))
    assert parts.take("r", (2, 3)) == blocks
    parts.failed("r", (0, 2), blocks)
    assert parts.outcomes == [] and parts.pool.num_free == NUM_BLOCKS - 2  # (2, 3) may still write them
    parts.landed("r", (2, 3), blocks)
    (outcome,) = parts.outcomes
    assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CHECKSUM_MISMATCH
    assert parts.released == [blocks] and parts.pool.num_free == NUM_BLOCKS
    assert parts.take("r", (3, 4)) is None  # a part of the failed request, late: refused, nothing more reported
    parts.failed("r", (3, 4), None, TransferStatus.REJECTED_NO_BLOCKS)
    assert len(parts.outcomes) == 1


def test_a_forgotten_request_fails_at_once_with_nothing_under_way_and_a_first_refusal_is_its_end():
    parts = Parts()
    blocks = parts.take("f", (0, 2))
    parts.landed("f", (0, 2), blocks)
    parts.assembler.forget("f")
    (outcome,) = parts.outcomes
    assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CANCELLED
    assert parts.pool.num_free == NUM_BLOCKS
    parts.assembler.forget("nothing")  # no part came: nothing to end here
    parts.pool.take(range(NUM_BLOCKS - 1))  # one block left: the request's first part finds no room
    assert parts.take("full", (0, 2)) is None
    parts.failed("full", (0, 2), None, TransferStatus.REJECTED_NO_BLOCKS)
    assert [o.status for o in parts.outcomes] == [TransferStatus.CANCELLED, TransferStatus.REJECTED_NO_BLOCKS]


def test_a_second_part_waits_for_the_first_to_take_the_blocks():
    taking, go = threading.Event(), threading.Event()
    pool = FreeListPool(FP, NUM_BLOCKS)

    def slow_allocate(request_id, n):  # a follower's wait for rank 0's Expect
        taking.set()
        go.wait(5)
        return pool.allocate(n)

    outcomes: list = []
    assembler = PartAssembler(pool.kv, HEADS, slow_allocate, outcomes.append, pool.free)
    first: list = []
    thread = threading.Thread(target=lambda: first.append(assembler.pool.windows((0, 2)).allocate_incoming("w", 2)))
    thread.start()
    taking.wait(5)
    later = threading.Thread(target=lambda: first.append(assembler.pool.windows((2, 4)).allocate_incoming("w", 2)))
    later.start()
    time.sleep(0.05)
    go.set()
    thread.join(5)
    later.join(5)
    assert first[0] == first[1] == [0, 1]


def test_a_grpc_receiver_whose_allocation_waits_serves_other_transfers_meanwhile():
    """A follower lane's allocation waits for rank 0's Expect: over gRPC it waits on another thread, so a second
    transfer to the same receiver lands while the first still waits."""
    config = transfer_config("grpc")
    expect = threading.Event()
    dst = FreeListPool(FP, NUM_BLOCKS)

    def allocate_for(request_id: str, num_blocks: int) -> list[int] | None:
        if request_id == "waits":
            expect.wait(10)
        return dst.allocate(num_blocks)

    receiver = create_receiver(config, KVPoolView(dst.kv, dst.allocate, dst.free, allocate_for,
                                                  allocation_waits=True), "grpc")
    src = FreeListPool(FP, NUM_BLOCKS)
    src.take(BLOCKS)
    fill_blocks(src.kv, BLOCKS, seed=8)
    sender = create_sender(config, KVPoolView(src.kv, refuse_allocation, keep_blocks), "grpc")
    try:
        waiting = sender.send(receiver.address, SendRequest("waits", BLOCKS, 15, 1))
        time.sleep(0.2)
        landed = sender.send(receiver.address, SendRequest("lands", BLOCKS, 15, 2))
        landed.result(10)
        assert not waiting.done()
        expect.set()
        waiting.result(10)
        outcomes = {outcome.request_id: outcome for outcome in (receiver.wait(10), receiver.wait(10))}
        assert [outcomes[rid].manifest.first_token for rid in ("lands", "waits")] == [2, 1]
        for outcome in outcomes.values():
            assert torch.equal(dst.kv[:, :, list(outcome.block_ids)], src.kv[:, :, list(BLOCKS)])
            dst.free(outcome.block_ids)
    finally:
        sender.close()
        receiver.close()
    assert dst.num_free == NUM_BLOCKS
