"""A spawned sender that ships runs as pool planes over gloo (TransferConfig.direct_min_plane_bytes=0).

It runs a fixed list of jobs in order and reports each outcome over a pipe. A `corrupt` job is driven by
hand on its own rank pair: its checksums are taken from the pool, then one pool byte is flipped before the
planes go out, which the real sender never does; the receiver must refuse the run.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer import (DistRendezvous, KVTransferError, ModelFingerprint, ReceiverAddress, SendRequest,
                         TransferConfig, create_sender)
from kv_transfer.dist.protocol import send_transfer
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, fill_blocks
from tests.support.child_processes import child_context
from tests.support.kv_hand_link import hand_link

PLANE_FP = ModelFingerprint(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)
SENDER_BLOCKS = 64
NAMESPACE = "planes"
SENDER_RANK, CORRUPT_RANK = 1, 2


@dataclass(frozen=True)
class PlaneJob:
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int
    seed: int
    corrupt: bool = False


def _corrupt_transfer(pool: FreeListPool, job: PlaneJob, config: TransferConfig, to: ReceiverAddress) -> str:
    outgoing = prepare_outgoing(pool.view(), SendRequest(job.key, job.block_ids, job.num_tokens, job.seed),
                                StagingPool("cpu"), direct_min_plane_bytes=0)
    if not all(outgoing.direct):
        return "NOT_DIRECT"
    pool.kv.view(torch.uint8)[1, 1, job.block_ids[-1], 2, 1, 3] ^= 0x5A  # after the checksum, before sending
    with hand_link(to, config, NAMESPACE, CORRUPT_RANK) as (conn, channel):
        try:
            send_transfer(conn, channel, outgoing, 0, time.monotonic() + 30, threading.Event())
            return "OK"
        except KVTransferError as exc:
            return exc.status.name


def _sender_main(to: ReceiverAddress, jobs: tuple[PlaneJob, ...], conn) -> None:
    pool = FreeListPool(PLANE_FP, SENDER_BLOCKS)
    config = TransferConfig(transport="gloo", kv_transfer_timeout_s=20, connect_timeout_s=30, direct_min_plane_bytes=0)
    rdzv = DistRendezvous(SENDER_RANK, 3, NAMESPACE)
    sender = create_sender(config, pool.view(), "gloo", rdzv)
    statuses = {}
    for job in jobs:
        pool.take(job.block_ids)
        fill_blocks(pool.kv, job.block_ids, job.seed)
        if job.corrupt:
            statuses[job.key] = _corrupt_transfer(pool, job, config, to)
            pool.free(job.block_ids)
            continue
        try:  # the sender frees the blocks itself
            sender.send(to, SendRequest(job.key, job.block_ids, job.num_tokens, job.seed)).result(30)
            statuses[job.key] = "OK"
        except KVTransferError as exc:
            statuses[job.key] = exc.status.name
    sender.close()
    conn.send((statuses, pool.num_free))


def run_plane_sender(to: ReceiverAddress, jobs: tuple[PlaneJob, ...],
                     timeout_s: float = 60) -> tuple[dict[str, str], int]:
    """Runs the jobs in a child process (child_context); returns ({key: status}, the sender pool's free blocks after)."""
    ctx = child_context()
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_sender_main, args=(to, jobs, child), daemon=True)
    process.start()
    try:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"plane sender did not finish within {timeout_s}s")
        return conn.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)
