"""Receiver side of one ipc transfer: copy each run from the sender's mapped pool into this side's blocks,
then verify it, with IncomingTransfer's ownership (accept allocates; exactly one of commit / fail)."""
from __future__ import annotations

from typing import Sequence

import torch

from kv_transfer.checksum import checksum_blocks
from kv_transfer.device_sync import copy_stream
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import RunInfo
from kv_transfer.runs import consecutive_start
from kv_transfer.status import KVTransferError, TransferStatus


class NoStaging:
    """The StagingPool of a transport that stages nothing: every run goes pool to pool. Hands out meta
    tensors (no memory), so prepare_outgoing can lay out its run views without memory (a MappedIncoming
    takes no staging at all)."""

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
    n, start = len(dst_ids), consecutive_start(dst_ids)
    if start is not None:
        target = kv[:, :, start : start + n]  # [L, 2, n, bs, H, D], a view of this side's blocks
        target.copy_(src)
        return target
    index = torch.tensor(list(dst_ids), dtype=torch.long, device=kv.device)  # [n]
    kv.index_copy_(2, index, src)
    return kv.index_select(2, index)  # [L, 2, n, bs, H, D]


def runs_start(runs: Sequence[RunInfo]) -> int | None:
    """The first block of runs (at least one) that follow each other without a gap, else None; O(runs)."""
    start = cursor = runs[0].start_block
    for run in runs:
        if run.start_block != cursor:
            return None
        cursor += run.num_blocks
    return start


def copy_block_lists(src_kv: torch.Tensor, src_runs: Sequence[RunInfo], kv: torch.Tensor,
                     dst_ids: Sequence[int]) -> None:
    """kv[:, :, dst_ids] = src_kv[:, :, the runs' blocks, in order] (pools [L, 2, N, bs, H, D]; the runs cover
    len(dst_ids) blocks): a slice copy when both sides' blocks are consecutive, else one index_select and
    one index_copy_ (two launches on CUDA, whatever the runs)."""
    n, src_start, dst_start = len(dst_ids), runs_start(src_runs), consecutive_start(dst_ids)
    if src_start is not None:
        src = src_kv.narrow(2, src_start, n)  # [L, 2, n, bs, H, D], a view of the sender's blocks
    else:
        src_ids = [block for run in src_runs for block in range(run.start_block, run.start_block + run.num_blocks)]
        src = src_kv.index_select(2, torch.tensor(src_ids, dtype=torch.long, device=src_kv.device))
    if dst_start is not None:
        kv.narrow(2, dst_start, n).copy_(src)
    else:
        kv.index_copy_(2, torch.tensor(list(dst_ids), dtype=torch.long, device=kv.device), src)


class MappedIncoming(IncomingTransfer):
    """An IncomingTransfer whose bytes never travel: landing copies the runs from `source` (the sender's
    pool, mapped into this process) into this side's blocks. A manifest without checksums (the real
    IpcSender's: a copy within one device crosses no wire) lands every run with one gather and one scatter
    (land_all); one with checksums lands run by run and checks each. Set `source` after accept(), before
    landing.

    Ownership is IncomingTransfer's: the blocks allocated in accept() belong to the transfer until
    commit() hands them to the caller or fail() frees them; fail() first waits for any copy still under
    way. The sender's blocks are only read, and only while the sender waits for the final ack."""

    source: torch.Tensor | None = None

    def _stage(self, sizes: list[int]) -> tuple[None, list[None]]:
        """No staging and no payload views: every run goes pool to pool (land / land_all)."""
        return None, [None] * len(sizes)

    @classmethod
    def accept_mapped(cls, manifest, pool, lander) -> "MappedIncoming":
        """accept() for a copy out of a mapped pool: the manifest carries a checksum for every run (each is
        verified) or for none (nothing is verified: the copy stays on one device). Raises KVTransferError
        as accept(), MALFORMED for a manifest with some checksums only."""
        if len({run.checksum is None for run in manifest.runs}) > 1:
            raise KVTransferError(TransferStatus.MALFORMED, "checksums for some runs only", manifest.request_id)
        return cls.accept(manifest, pool, NO_STAGING, lander, trailing_checksums=True)

    def landed_all(self) -> None:
        """Every run is to be copied: with checksums, run by run (landed(i), each verified); without, all at
        once (land_all), on the lander if there is one, else here. commit() waits for it."""
        if all(run.checksum is not None for run in self.manifest.runs):
            for index in range(len(self.manifest.runs)):
                self.landed(index)
            return
        landing = self._lander.submit(self.land_all) if self._lander is not None else None
        if landing is None:
            self.land_all()
        self._landings.extend([landing] + [None] * (self.num_pieces - 1))

    def land_all(self) -> None:
        """Copies every run from the sender's blocks into this side's blocks: one copy when both sides' ids
        are consecutive, else one gather and one scatter over the block lists. On CUDA on a side stream,
        complete on return."""
        with copy_stream(self.pool.device):
            copy_block_lists(self.source, self.manifest.runs, self.pool.kv, self.block_ids)

    def land(self, index: int, in_place: bool = False, summed: int | None = None) -> None:
        """Copies run `index` from the sender's blocks into this side's blocks and verifies them; raises
        KVTransferError(CHECKSUM_MISMATCH). On CUDA the copy runs on a side stream and is complete on return.
        (No bytes pass a reader here: summed is always None, the copy is summed once made.)"""
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
