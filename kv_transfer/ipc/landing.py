"""Receiver side of one ipc transfer: copy each run from the sender's mapped pool into this side's blocks,
then verify it, with IncomingTransfer's ownership (accept allocates; exactly one of commit / fail)."""
from __future__ import annotations

from typing import Sequence

import torch

from kv_transfer.checksum import checksum_blocks
from kv_transfer.device_sync import copy_stream
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.status import KVTransferError, TransferStatus


class NoStaging:
    """The StagingPool of a transport that stages nothing: every run goes pool to pool. Hands out meta
    tensors (no memory), so IncomingTransfer / prepare_outgoing can lay out their run views for free."""

    device = torch.device("meta")

    def acquire(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def release(self, view: torch.Tensor) -> None:
        pass


NO_STAGING = NoStaging()


def copy_blocks(src: torch.Tensor, kv: torch.Tensor, dst_ids: Sequence[int]) -> torch.Tensor:
    """Copies src [L, 2, n, bs, H, D] (a run of the sender's mapped pool) into kv's blocks dst_ids (n ids,
    any order) with one copy, and returns those blocks in run order for the checksum: a view of kv when the
    ids are consecutive, else a gathered copy (at most one run, max_run_bytes)."""
    n, start = len(dst_ids), dst_ids[0]
    if tuple(dst_ids) == tuple(range(start, start + n)):
        target = kv[:, :, start : start + n]  # [L, 2, n, bs, H, D], a view of this side's blocks
        target.copy_(src)
        return target
    index = torch.tensor(list(dst_ids), dtype=torch.long, device=kv.device)  # [n]
    kv.index_copy_(2, index, src)
    return kv.index_select(2, index)  # [L, 2, n, bs, H, D]


class MappedIncoming(IncomingTransfer):
    """An IncomingTransfer whose bytes never travel: landing run i copies it from `source` (the sender's
    pool, mapped into this process) into this side's blocks, then checks the run's checksum against the
    manifest. Set `source` after accept(), before the first landed(i).

    Ownership is IncomingTransfer's: the blocks allocated in accept() belong to the transfer until
    commit() hands them to the caller or fail() frees them; fail() first waits for any copy still under
    way. The sender's blocks are only read, and only while the sender waits for the final ack."""

    source: torch.Tensor | None = None

    def land(self, index: int, in_place: bool = False) -> None:
        """Copies run `index` from the sender's blocks into this side's blocks and verifies them; raises
        KVTransferError(CHECKSUM_MISMATCH). On CUDA the copy runs on a side stream and is complete on return."""
        run = self.manifest.runs[index]
        first = self._first_block[index]
        dst = self.block_ids[first : first + run.num_blocks]
        src = self.source[:, :, run.start_block : run.start_block + run.num_blocks]  # [L, 2, n, bs, H, D]
        with copy_stream(self.pool.device):
            landed = copy_blocks(src, self.pool.kv, dst)
            if checksum_blocks(landed) != run.checksum:
                last = run.start_block + run.num_blocks - 1
                raise KVTransferError(TransferStatus.CHECKSUM_MISMATCH, f"run {index} (sender blocks "
                                      f"{run.start_block}..{last}) failed its checksum", self.manifest.request_id)
