"""Sender side of one transfer: describe the request's runs in a manifest, gather them into staging.

A whole-request transfer's pieces are its block runs (all layers each). A layer-streamed one's pieces are
its layers (one layer of every block each), gathered as soon as the step's LayerClock says the layer is
written, each followed by its checksum; the first token follows the last layer (the tail)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.checksum import checksum_blocks
from kv_transfer.device_sync import copy_stream
from kv_transfer.host_copy import take_blocks
from kv_transfer.layer_stream import LayerStream
from kv_transfer.manifest import Manifest, RunInfo, encode_manifest
from kv_transfer.pool import HostPieces, KVPoolView
from kv_transfer.results import SendRequest
from kv_transfer.runs import (BlockRun, block_planes, gather_run, group_runs, layer_piece_shape,
                             split_pieces, staging_offsets)
from kv_transfer.staging import StagingPool
from kv_transfer.stream_tail import encode_tail


@dataclass
class OutgoingTransfer:
    """A transfer ready for the wire. Run i travels either as its pool planes (direct[i]: planes(i), no
    copy) or gathered: run_payloads[i] (flat uint8 in staging) holds its bytes once gather(i) has run.
    The manifest's checksums were taken from the pool."""

    manifest: Manifest
    manifest_bytes: bytes
    pool: KVPoolView
    runs: list[BlockRun]
    staging: torch.Tensor
    run_payloads: list[torch.Tensor | None]  # None for a direct run
    gathered: list[bool]
    direct: list[bool]
    ready_event: "torch.cuda.Event | None" = None  # CUDA: the pool's KV is written once this completes
    stream: LayerStream | None = None  # layer-streamed: run_payloads are layers, gathered as they are written
    deadline: float = float("inf")     # time.monotonic() by which the stream's layers and tail must be in
    layer_checksums: list[int | None] = field(default_factory=list)
    _gather_lock: threading.Lock = field(default_factory=threading.Lock)  # one gather per piece, whoever asks

    @property
    def num_pieces(self) -> int:
        """Pieces in wire order: runs, or the layers of a streamed transfer."""
        return len(self.run_payloads)

    def gather(self, index: int) -> None:
        """Copies piece `index` from the pool into its staging piece once (complete on return); a no-op
        for a direct run. A streamed layer waits for the step to have written it first (raises
        KVTransferError ABORTED_BY_SENDER or TIMEOUT when it never will be)."""
        if self.direct[index]:
            return
        with self._gather_lock:
            if self.gathered[index]:
                return
            if self.stream is not None:
                self._gather_layer(index)
            else:
                with copy_stream(self.pool.device, after=self.ready_event):
                    gather_run(self.pool.kv, self.runs[index], self.run_payloads[index], self.manifest.fingerprint)
            self.gathered[index] = True

    def _gather_layer(self, layer: int) -> None:
        written = self.stream.wait_layer(layer, self.deadline)
        fp, payload = self.manifest.fingerprint, self.run_payloads[layer]
        out = payload.view(self.pool.kv.dtype).view(layer_piece_shape(fp, self.manifest.num_blocks))
        with copy_stream(self.pool.device, after=written):  # complete on exit
            take_blocks(out, self.pool.kv[layer], self.manifest.block_ids, dim=1)  # [2, N, bs, H, D]
        self.layer_checksums[layer] = checksum_blocks(out.unsqueeze(0))

    def checksum(self, index: int) -> int:
        """Piece `index`'s rowsum64 (for a manifest that leaves it out): a run's read straight from the
        sender's pool, a streamed layer's taken when it was gathered."""
        if self.stream is not None:
            self.gather(index)
            return self.layer_checksums[index]
        run = self.runs[index]
        with copy_stream(self.pool.device, after=self.ready_event):
            return checksum_blocks(self.pool.kv[:, :, run.start : run.start + run.num_blocks])

    def tail(self) -> bytes | None:
        """A streamed transfer's tail once the step sampled the first token (None: not streamed). Raises
        KVTransferError ABORTED_BY_SENDER (the first token ended the request, the step failed, a cancel)
        or TIMEOUT."""
        if self.stream is None:
            return None
        tail = self.stream.wait_tail(self.deadline)
        return encode_tail(tail.first_token, tail.first_logprobs)

    def gather_all(self) -> None:
        for index in range(len(self.runs)):
            self.gather(index)

    def pieces(self, index: int) -> list[torch.Tensor]:
        """Run `index`'s bytes in wire order as flat uint8 tensors: its pool planes (direct) or its staging
        piece (gathered: call gather(index) first)."""
        return self.planes(index) if self.direct[index] else [self.run_payloads[index]]

    def host_pieces(self, index: int) -> HostPieces:
        """pieces(index) as host views (pool.HostPieces), for a transport that writes host memory to a socket: a
        direct run's planes straight from the host pool (no torch op per plane), a gathered run's host staging piece
        (one piece)."""
        if not self.direct[index]:
            return split_pieces(self.run_payloads[index].numpy(), 1)
        run = self.runs[index]
        return self.pool.host_planes(run.start, run.num_blocks)

    def planes(self, index: int) -> list[torch.Tensor]:
        """The 2 * num_layers pool planes of direct run `index` (flat uint8 views into the pool, in
        staging order). They must stay untouched until the transfer ends; the sender owns the blocks."""
        run = self.runs[index]
        return block_planes(self.pool.kv[:, :, run.start : run.start + run.num_blocks])


def prepare_streamed(pool: KVPoolView, request: SendRequest, staging_pool: StagingPool,
                     timeout_s: float) -> OutgoingTransfer:
    """The manifest (no checksums, no first token) and one staging piece per layer of a layer-streamed
    request; gathers nothing (each layer waits for the step). Reads nothing from the pool."""
    fp = pool.fingerprint
    runs = group_runs(request.block_ids)
    infos = tuple(RunInfo(r.start, r.num_blocks, r.num_blocks * fp.block_nbytes, None) for r in runs)
    manifest = Manifest(request_id=request.request_id, fingerprint=fp, num_tokens=request.num_tokens,
                        block_ids=tuple(request.block_ids), first_token=None, runs=infos, streamed=True,
                        prefix_blocks=request.prefix_blocks, kv_heads=pool.kv_heads)
    sizes = manifest.piece_nbytes
    offsets, total = staging_offsets(sizes)
    staging = staging_pool.acquire(total)
    payloads = [staging[off : off + size] for off, size in zip(offsets, sizes)]
    return OutgoingTransfer(manifest, encode_manifest(manifest), pool, runs, staging, payloads,
                            [False] * len(sizes), [False] * len(sizes), None, request.stream,
                            time.monotonic() + timeout_s, [None] * len(sizes))


def prepare_outgoing(pool: KVPoolView, request: SendRequest, staging_pool: StagingPool,
                     ready_event: "torch.cuda.Event | None" = None, max_run_bytes: int = 0,
                     direct_min_plane_bytes: int | None = None, trailing_checksums: bool = False,
                     stream_timeout_s: float = 60.0, all_direct: bool = False) -> OutgoingTransfer:
    """Splits request.block_ids into runs (at most max_run_bytes each, 0: unbounded), checksums each
    run straight from the pool and builds the manifest; reserves staging but gathers nothing yet.
    trailing_checksums: the manifest leaves every checksum out (the transport sends checksum(i) after
    run i's bytes), so nothing is read from the pool here.
    A run is direct (sent as its pool planes) when direct_min_plane_bytes is set, the pool lives on the
    staging device (the wire's device) and each plane has at least that many bytes; the other runs get
    staging; a head window's runs are all gathered. all_direct: every run is direct and no staging view is laid
    out (ipc: the receiver reads the runs straight out of this pool; inline gloo from a host pool: the planes go on
    the socket in scatter-gather writes, no gather). Reads the pool, changes nothing in it. A streamed request
    (request.stream) is laid out by prepare_streamed instead (its layers must be in within stream_timeout_s)."""
    if request.stream is not None:
        return prepare_streamed(pool, request, staging_pool, stream_timeout_s)
    fp = pool.fingerprint
    runs = group_runs(request.block_ids, max(1, max_run_bytes // fp.block_nbytes) if max_run_bytes else 0)
    if trailing_checksums:
        sums: list[int | None] = [None] * len(runs)
    else:
        with copy_stream(pool.device, after=ready_event):
            sums = [checksum_blocks(pool.kv[:, :, run.start : run.start + run.num_blocks]) for run in runs]
    infos = tuple(RunInfo(r.start, r.num_blocks, r.num_blocks * fp.block_nbytes, s) for r, s in zip(runs, sums))
    manifest = Manifest(request_id=request.request_id, fingerprint=fp, num_tokens=request.num_tokens,
                        block_ids=tuple(request.block_ids), first_token=request.first_token, runs=infos,
                        first_logprobs=request.first_logprobs, prefix_blocks=request.prefix_blocks,
                        kv_heads=pool.kv_heads)
    if not pool.contiguous:  # a head window's planes are not contiguous: every run is gathered
        direct = [False] * len(infos)
    elif all_direct:
        direct = [True] * len(infos)
    elif direct_min_plane_bytes is not None and staging_pool.device == pool.device:
        direct = [info.nbytes // (2 * fp.num_layers) >= direct_min_plane_bytes for info in infos]
    else:
        direct = [False] * len(infos)
    offsets, total = staging_offsets([0 if d else info.nbytes for d, info in zip(direct, infos)])
    staging = staging_pool.acquire(total)
    payloads = [None if d else staging[off : off + info.nbytes] for d, off, info in zip(direct, offsets, infos)]
    return OutgoingTransfer(manifest, encode_manifest(manifest), pool, runs, staging, payloads,
                            [False] * len(runs), direct, ready_event)
