"""An inline transfer's bytes, cut into batches: rows summed while in cache, each batch moved in one scatter-gather call
(kv_transfer/dist/inline.py sends and reads them behind the TRANSFER frame). While one side sums a batch, the other
moves the one before. The frame goes alone, before the first batch is summed, so the receiver works on the manifest
while the sender sums and sends.
"""
from __future__ import annotations

import struct
from typing import Iterator

import numpy as np

from kv_transfer.checksum import RunChecksum
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import HostPieces

RUN_CHECKSUM = struct.Struct("<Q")  # a whole request's run checksum, behind the run's bytes
BATCH_BYTES = 512 << 10  # rows summed, then written or read in one call (in a core's L2) while the peer moves the last

Cut = tuple[slice, slice]  # a batch: which pieces, and which bytes of each


def byte_batches(count: int, nbytes: int, row_nbytes: int) -> list[Cut]:
    """How a run of `count` pieces of nbytes each (whole rows: a row is a block of one layer's K or V) is cut, in
    order, into batches of at most BATCH_BYTES: k whole pieces where a piece fits, else one piece's part cut at a row
    boundary (one row when a row is larger). Each batch is summed in one call (RunChecksum.add), then moved in one
    scatter-gather call while it is still in cache; while one side sums a batch, the other moves the one before."""
    if nbytes <= BATCH_BYTES:
        per_batch = BATCH_BYTES // nbytes
        return [(slice(first, first + per_batch), slice(None)) for first in range(0, count, per_batch)]
    take = max(1, BATCH_BYTES // row_nbytes) * row_nbytes
    return [(slice(piece, piece + 1), slice(offset, offset + take)) for piece in range(count)
            for offset in range(0, nbytes, take)]


def batch(pieces: HostPieces, cut: Cut) -> tuple[np.ndarray, list[memoryview]]:
    """One batch of a run's pieces: [k, bytes] uint8 to sum, and its pieces' flat memoryviews to move."""
    (planes, buffers), (which, part) = pieces, cut
    return planes[which, part], [buffer[part] for buffer in buffers[which]]


def inline_writes(outgoing: OutgoingTransfer) -> Iterator[list]:
    """A whole request's bytes behind its frame, one scatter-gather write at a time: per run, its pieces in
    batches, each summed (in cache) just before it is yielded, the run's checksum behind its last batch. Every
    gather completes before its bytes are yielded."""
    fingerprint = outgoing.manifest.fingerprint
    for index, run in enumerate(outgoing.manifest.runs):
        outgoing.gather(index)
        summed = RunChecksum.of_run(fingerprint, run.num_blocks)
        pieces = outgoing.host_pieces(index)  # the planes, or the gathered run
        cuts = byte_batches(*pieces[0].shape, fingerprint.row_nbytes)
        for number, cut in enumerate(cuts, 1):
            rows, views = batch(pieces, cut)
            summed.add(rows)
            yield views + [RUN_CHECKSUM.pack(summed.value())] if number == len(cuts) else views
