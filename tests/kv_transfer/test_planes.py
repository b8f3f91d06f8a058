"""gloo runs sent as pool planes (no gather): they land straight in the receiver's blocks when those are
consecutive ids, through staging when not, bit for bit; a plane corrupted after checksumming is refused."""
from __future__ import annotations

import random

from kv_transfer import DistRendezvous, ReceivedKV, ReceiveFailed, TransferConfig, create_receiver
from kv_transfer.testing import FreeListPool, blocks_bytes
from tests.support.kv_plane_sender import (CORRUPT_RANK, NAMESPACE, PLANE_FP, SENDER_BLOCKS, SENDER_RANK, PlaneJob,
                                           run_plane_sender)
from tests.support.kv_scenarios import expected_bytes

RECEIVER_BLOCKS = 48
CONSECUTIVE = 16  # the receiver hands out ids 0..15 in order first, then shuffled ones


def receiver_pool() -> FreeListPool:
    rest = list(range(CONSECUTIVE, RECEIVER_BLOCKS))
    random.Random(5).shuffle(rest)
    return FreeListPool(PLANE_FP, RECEIVER_BLOCKS, free_order=list(range(CONSECUTIVE)) + rest)


def test_planes_land_in_place_or_staged_and_corruption_is_caught():
    bs = PLANE_FP.block_size
    jobs = (
        PlaneJob("corrupt", (40, 41, 42, 43), 4 * bs, seed=1, corrupt=True),      # lands in place (ids 0..3)
        PlaneJob("in-place", tuple(range(2, 14)), 12 * bs - 1, seed=2),           # ids 4..15: in place
        PlaneJob("staged", (20, 21, 22, 30, 31, 50), 6 * bs, seed=3),             # shuffled ids: via staging
    )
    pool = receiver_pool()
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=20, connect_timeout_s=30)
    rdzv = DistRendezvous(rank=0, world_size=3, namespace=NAMESPACE)
    receiver = create_receiver(config, pool.view(), "gloo", rendezvous=rdzv, peers=[SENDER_RANK, CORRUPT_RANK])
    try:
        statuses, sender_free = run_plane_sender(receiver.address, jobs)
        outcomes = {o.request_id: o for o in (receiver.wait(30) for _ in jobs)}
    finally:
        receiver.close()
    assert statuses == {"corrupt": "CHECKSUM_MISMATCH", "in-place": "OK", "staged": "OK"}
    assert sender_free == SENDER_BLOCKS, "the sender leaks blocks"
    failed = outcomes["corrupt"]
    assert isinstance(failed, ReceiveFailed) and failed.status.name == "CHECKSUM_MISMATCH", failed
    for job in jobs[1:]:
        got = outcomes[job.key]
        assert isinstance(got, ReceivedKV), got
        assert blocks_bytes(pool.kv, got.block_ids) == expected_bytes(PLANE_FP, len(job.block_ids), job.seed)
        pool.free(got.block_ids)
    assert outcomes["in-place"].block_ids == tuple(range(4, 16))
    staged = outcomes["staged"].block_ids
    assert staged != tuple(range(staged[0], staged[0] + len(staged))), "the staged case needs scattered ids"
    assert pool.num_free == RECEIVER_BLOCKS, "the receiver leaks blocks"
