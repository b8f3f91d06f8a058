"""Receiver side of one transfer: allocate, take bytes into its blocks or staging, verify, scatter, or free."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future
from itertools import accumulate

import numpy as np
import torch

from kv_transfer.checksum import checksum_blocks
from kv_transfer.device_sync import copy_stream
from kv_transfer.host_copy import put_blocks
from kv_transfer.manifest import Manifest, ManifestError
from kv_transfer.pool import HostPieces, KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed
from kv_transfer.runs import (as_blocks, block_planes, consecutive_start, layer_piece_shape, scatter_run,
                             split_pieces, staging_offsets)
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.stream_tail import complete_manifest


class IncomingTransfer:
    """Owns the receiver blocks of one transfer from accept() until exactly one of commit() (the blocks go
    to the caller, written and verified) or fail() (the blocks go back to the pool) has run.

    A run's bytes arrive straight in this side's blocks when their ids are consecutive (plane_targets),
    else in staging. Each run is landed (checksum-verified, then scattered from staging if it came that way)
    as soon as its bytes are complete, on `lander` when given, so landing overlaps the next run's arrival.
    A run whose checksum the manifest leaves out lands once run_checksum() has supplied it."""

    def __init__(self, manifest: Manifest, pool: KVPoolView, staging_pool: StagingPool, block_ids: list[int],
                 lander: Executor | None = None, host_reads: bool = False):
        self.manifest, self.pool, self.block_ids = manifest, pool, tuple(block_ids)
        self.started = time.monotonic()
        self._staging_pool, self._lander = staging_pool, lander
        self._first_block = list(accumulate((r.num_blocks for r in manifest.runs), initial=0))
        sizes = manifest.piece_nbytes  # a run each, or (streamed) a layer each
        if host_reads and not manifest.streamed and pool.on_host:  # runs host_targets fills in place
            sizes = [0 if self._consecutive(index) else size for index, size in enumerate(sizes)]
        self._staging, self.payloads = self._stage(sizes)
        self._landings: list[Future | None] = []
        self._cursor = (0, 0, 0)  # (run index, target piece, byte offset in it) of the next streamed byte
        self._stream_targets: tuple[np.ndarray, bool] | None = None  # pieces of the streamed run
        self._checksums: list[int | None] = [None] * len(self.payloads) if manifest.streamed else \
            [run.checksum for run in manifest.runs]
        self._awaiting_checksum: tuple[int, bool] | None = None  # (run, in place): bytes in, checksum not yet
        self.bytes_written = 0
        self._settle_lock = threading.Lock()
        self._settled = False

    def _stage(self, sizes: list[int]) -> tuple[torch.Tensor | None, list]:
        """Acquires this transfer's staging for pieces of `sizes` bytes; returns it and each piece's flat uint8
        view into it, in order (released by commit or fail)."""
        offsets, total = staging_offsets(sizes)
        staging = self._staging_pool.acquire(total)
        return staging, [staging[off : off + size] if size else None for off, size in zip(offsets, sizes)]

    def _consecutive(self, index: int) -> bool:
        """Whether run `index` lands in consecutive block ids of this side (so its planes are contiguous, unless the
        pool is a head window: its runs always land from staging)."""
        if not self.pool.contiguous:
            return False
        first = self._first_block[index]
        return consecutive_start(self.block_ids[first : first + self.manifest.runs[index].num_blocks]) is not None

    @classmethod
    def accept(cls, manifest: Manifest, pool: KVPoolView, staging_pool: StagingPool,
               lander: Executor | None = None, trailing_checksums: bool = False,
               host_reads: bool = False) -> "IncomingTransfer":
        """Checks the manifest against this pool and allocates its blocks. trailing_checksums: whether this
        transport can carry checksums after the runs (otherwise the manifest must hold every one). host_reads:
        the transport reads every run from a socket through host_targets (so a host pool's runs into consecutive
        blocks need no staging: they are read in place).
        Raises KVTransferError (MALFORMED / REJECTED_FINGERPRINT / REJECTED_NO_BLOCKS); nothing is held then."""
        rid = manifest.request_id
        if manifest.trailing_checksums and not (trailing_checksums or manifest.streamed):  # layers' always trail
            raise KVTransferError(TransferStatus.MALFORMED, "this transport needs every run's checksum in the manifest",
                                  rid)
        landing = pool.landing_view(manifest.kv_heads)  # a lane's heads only into the rank that holds them
        if landing is None:
            raise KVTransferError(TransferStatus.REJECTED_FINGERPRINT, f"KV heads differ: {manifest.kv_heads} sent, "
                                  f"this pool holds {pool.kv_heads or 'all'}", rid)
        pool = landing
        diff = pool.fingerprint.mismatch(manifest.fingerprint)
        if diff:
            raise KVTransferError(TransferStatus.REJECTED_FINGERPRINT, f"KV layout differs: {diff}", rid)
        block_ids = pool.allocate_incoming(rid, manifest.num_blocks)
        if block_ids is None:
            raise KVTransferError(TransferStatus.REJECTED_NO_BLOCKS, f"no room for {manifest.num_blocks} blocks", rid)
        try:
            if len(block_ids) != manifest.num_blocks:
                raise KVTransferError(TransferStatus.INTERNAL, "allocate returned the wrong number of blocks", rid)
            return cls(manifest, pool, staging_pool, block_ids, lander, host_reads)
        except BaseException:
            pool.free(block_ids)
            raise

    @property
    def num_pieces(self) -> int:
        """Pieces in wire order: the manifest's runs, or a streamed transfer's layers."""
        return len(self.payloads)  # one entry per piece (None: a run read in place, with no staging)

    def land(self, index: int, in_place: bool = False, summed: int | None = None) -> None:
        """Verifies piece `index` against its checksum, then writes it into this side's blocks: from staging
        (scatter), or, in_place, it is already there and only the blocks are verified. summed: the piece's
        checksum as the reader took it while the bytes came in (RunChecksum), instead of a pass over them."""
        if self.manifest.streamed:
            self._land_layer(index)
            return
        run, fp = self.manifest.runs[index], self.manifest.fingerprint
        if in_place and summed is not None:  # the bytes are where they belong and were summed on their way in
            self._check(index, summed)
            return
        first = self._first_block[index]
        dst = self.block_ids[first : first + run.num_blocks]
        with copy_stream(self.pool.device):
            if in_place:
                landed = self.pool.kv[:, :, dst[0] : dst[0] + run.num_blocks]  # [L, 2, n, bs, H, D]
            else:
                landed = as_blocks(self.payloads[index], fp, run.num_blocks)
            self._check(index, checksum_blocks(landed) if summed is None else summed)
            if not in_place:
                scatter_run(self.pool.kv, self.payloads[index], fp, dst)

    def _check(self, index: int, checksum: int) -> None:
        """KVTransferError CHECKSUM_MISMATCH unless checksum is run `index`'s."""
        if checksum != self._checksums[index]:
            run = self.manifest.runs[index]
            last = run.start_block + run.num_blocks - 1
            raise KVTransferError(TransferStatus.CHECKSUM_MISMATCH, f"run {index} (sender blocks "
                                  f"{run.start_block}..{last}) failed its checksum", self.manifest.request_id)

    def _land_layer(self, layer: int) -> None:
        """A streamed layer: verify its staging piece, then write it into layer `layer` of this side's blocks."""
        fp = self.manifest.fingerprint
        piece = self.payloads[layer].view(self.pool.kv.dtype).view(layer_piece_shape(fp, len(self.block_ids)))
        with copy_stream(self.pool.device):
            if checksum_blocks(piece.unsqueeze(0)) != self._checksums[layer]:
                raise KVTransferError(TransferStatus.CHECKSUM_MISMATCH, f"layer {layer} failed its checksum",
                                      self.manifest.request_id)
            put_blocks(self.pool.kv[layer], piece, self.block_ids, dim=1)  # [2, N, bs, H, D]

    def landed(self, index: int, in_place: bool = False, checksum: int | None = None, inline: bool = False,
               summed: int | None = None) -> None:
        """Piece `index` is complete (in staging, or in place in this side's blocks): land it on the lander
        thread, or now (no lander, inline: the last piece, which nothing would overlap with, or a run in place
        whose checksum was summed as it came in: nothing left to do but compare). checksum: the piece's
        trailing checksum, when the manifest left it out; summed: as for land()."""
        if checksum is not None:
            self._checksums[index] = checksum
        if self._lander is None or inline or (in_place and summed is not None):
            self.land(index, in_place, summed)
            self._landings.append(None)
        else:
            self._landings.append(self._lander.submit(self.land, index, in_place, summed))

    def plane_targets(self, index: int, wire_device: torch.device) -> tuple[list[torch.Tensor], bool]:
        """Where the 2 * num_layers plane messages of run `index` go: straight into this side's blocks when
        they are consecutive ids and the pool lives on the wire's device (True), else into the run's staging
        piece (False). The blocks belong to this transfer, so unverified bytes may land in them."""
        run, first = self.manifest.runs[index], self.block_ids[self._first_block[index]]
        if self._consecutive(index) and self.pool.device == torch.device(wire_device):
            return block_planes(self.pool.kv[:, :, first : first + run.num_blocks]), True
        return block_planes(as_blocks(self.payloads[index], self.manifest.fingerprint, run.num_blocks)), False

    def host_targets(self, index: int) -> tuple[HostPieces, bool]:
        """plane_targets for bytes read from a socket into host memory, as host views of its 2L planes
        (pool.HostPieces): straight into this side's blocks when their ids are consecutive and the pool is on the
        host (True), else the planes of the run's host staging piece (False). No torch op per plane."""
        if self.pool.on_host and self._consecutive(index):
            first = self.block_ids[self._first_block[index]]
            return self.pool.host_planes(first, self.manifest.runs[index].num_blocks), True
        return split_pieces(self.payloads[index].numpy(), 2 * self.manifest.fingerprint.num_layers), False

    def _stream_pieces(self, index: int) -> tuple[np.ndarray, bool]:
        """Where a streamed run's bytes go, in order ([pieces, bytes] uint8, row i piece i): its planes in this
        side's blocks (in place), or its whole staging piece (always, for a layer of a layer-streamed transfer)."""
        if not self.manifest.streamed:
            (planes, _), in_place = self.host_targets(index)
            if in_place:
                return planes, True
        return self.payloads[index].numpy().reshape(1, -1), False

    def write(self, data: bytes | memoryview) -> None:
        """Appends streamed run bytes (runs concatenated in manifest order, no padding), straight into this
        side's blocks where plane_targets allows, else into staging; lands each run as it completes (or
        once its trailing checksum is in). Raises KVTransferError: LENGTH_MISMATCH on bytes beyond the
        manifest, MALFORMED on bytes where a run's trailing checksum is due."""
        if self._awaiting_checksum is not None:
            raise self._checksum_due(self._awaiting_checksum[0])
        view, position = memoryview(data), 0
        run_index, piece, offset = self._cursor
        while position < len(view):
            if run_index >= len(self.payloads):
                raise KVTransferError(TransferStatus.LENGTH_MISMATCH, "more bytes than the manifest announced",
                                      self.manifest.request_id)
            if self._stream_targets is None:
                self._stream_targets = self._stream_pieces(run_index)
            targets, in_place = self._stream_targets
            dst = targets[piece]
            take = min(len(view) - position, dst.size - offset)
            dst[offset : offset + take] = np.frombuffer(view[position : position + take], dtype=np.uint8)
            position, offset = position + take, offset + take
            if offset == dst.size:
                piece, offset = piece + 1, 0
            if piece == len(targets):
                self._run_bytes_in(run_index, in_place, more_bytes=position < len(view))
                run_index, piece, self._stream_targets = run_index + 1, 0, None
        self._cursor = (run_index, piece, offset)
        self.bytes_written += len(view)

    def _run_bytes_in(self, index: int, in_place: bool, more_bytes: bool) -> None:
        """Run `index`'s last byte is in: land it, or wait for its trailing checksum (which must come
        before any further byte)."""
        if self._checksums[index] is not None:
            self.landed(index, in_place=in_place)
            return
        self._awaiting_checksum = (index, in_place)
        if more_bytes:
            raise self._checksum_due(index)

    def _checksum_due(self, index: int) -> KVTransferError:
        return KVTransferError(TransferStatus.MALFORMED, f"run {index}'s checksum must follow its bytes",
                               self.manifest.request_id)

    def run_checksum(self, checksum: int) -> None:
        """The trailing checksum of the run whose bytes just ended: lands that run. Raises
        KVTransferError(MALFORMED) when no run is waiting for one."""
        if self._awaiting_checksum is None:
            raise KVTransferError(TransferStatus.MALFORMED, "a run checksum where none is due",
                                  self.manifest.request_id)
        (index, in_place), self._awaiting_checksum = self._awaiting_checksum, None
        self._checksums[index] = checksum
        self.landed(index, in_place=in_place)

    @property
    def complete(self) -> bool:
        """Every run's bytes (and trailing checksum) are in; landing may still be under way."""
        return len(self._landings) == self.num_pieces

    def set_tail(self, tail: bytes) -> None:
        """A streamed transfer's tail (the first token): completes the manifest. KVTransferError(MALFORMED)
        if it is malformed or none is due (then the caller fails the transfer)."""
        try:
            self.manifest = complete_manifest(self.manifest, tail)
        except ManifestError as exc:
            raise KVTransferError(TransferStatus.MALFORMED, str(exc), self.manifest.request_id) from None

    def commit(self) -> ReceivedKV:
        """Waits for every run to have landed; on success the blocks belong to the caller. Raises
        KVTransferError (LENGTH_MISMATCH, CHECKSUM_MISMATCH, ...) otherwise; the caller then calls fail()."""
        rid = self.manifest.request_id
        if self._awaiting_checksum is not None:
            raise KVTransferError(TransferStatus.LENGTH_MISMATCH, f"run {self._awaiting_checksum[0]}'s checksum "
                                  "never arrived", rid)
        if not self.complete:
            raise KVTransferError(TransferStatus.LENGTH_MISMATCH, f"got {self.bytes_written} of "
                                  f"{self.manifest.total_nbytes} bytes ({len(self._landings)} of "
                                  f"{self.num_pieces} pieces)", rid)
        if self.manifest.first_token is None:
            raise KVTransferError(TransferStatus.LENGTH_MISMATCH, "the stream's tail (first token) never arrived", rid)
        for landing in self._landings:
            if landing is not None:
                landing.result()
        if not self._settle():
            raise KVTransferError(TransferStatus.INTERNAL, "transfer already settled", rid)
        self._release_staging()
        return ReceivedKV(self.manifest, self.block_ids, self.manifest.total_nbytes, time.monotonic() - self.started)

    def fail(self, status: TransferStatus, message: str) -> ReceiveFailed:
        """Frees this transfer's blocks (once; a no-op after commit or an earlier fail) and describes why."""
        if self._settle():
            for landing in self._landings:  # nothing may still write into the blocks or read staging
                if landing is not None:
                    landing.exception()
            self.pool.free(self.block_ids)
            self._release_staging()
        return ReceiveFailed(self.manifest.request_id, status, message)

    def _settle(self) -> bool:
        """True for the first caller only: that caller decides where the blocks go."""
        with self._settle_lock:
            first, self._settled = not self._settled, True
            return first

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._staging_pool.release(self._staging)
            self._staging = None
