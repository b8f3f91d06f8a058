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

RUN_CHECKSUM = struct.Struct("<Q")  # a whole request's run checksum, behind the run's bytes
BATCH_BYTES = 512 << 10  # rows summed, then written or read in one call (in a core's L2) while the peer moves the last


def byte_batches(pieces: np.ndarray, row_nbytes: int) -> list[np.ndarray]:
    """A run's pieces ([pieces, bytes] uint8, each piece whole rows and contiguous: a row is a block of one layer's
    K or V) in order, cut into batches of at most BATCH_BYTES, each a [k, bytes] view: k whole pieces where a piece
    fits, else one piece's part cut at a row boundary (one row when a row is larger). Each batch is summed in one
    call (RunChecksum.add), then moved in one scatter-gather call while it is still in cache; while one side sums a
    batch, the other moves the one before."""
    count, nbytes = pieces.shape
    if nbytes <= BATCH_BYTES:
        per_batch = BATCH_BYTES // nbytes
        return [pieces[first : first + per_batch] for first in range(0, count, per_batch)]
    take = max(1, BATCH_BYTES // row_nbytes) * row_nbytes
    return [pieces[piece : piece + 1, offset : offset + take] for piece in range(count)
            for offset in range(0, nbytes, take)]


def inline_writes(outgoing: OutgoingTransfer) -> Iterator[list]:
    """A whole request's bytes behind its frame, one scatter-gather write at a time: per run, its pieces in
    batches, each summed (in cache) just before it is yielded, the run's checksum behind its last batch. Every
    gather completes before its bytes are yielded."""
    fingerprint = outgoing.manifest.fingerprint
    for index, run in enumerate(outgoing.manifest.runs):
        outgoing.gather(index)
        summed = RunChecksum.of_run(fingerprint, run.num_blocks)
        batches = byte_batches(outgoing.host_pieces(index), fingerprint.row_nbytes)  # the planes, or the gathered run
        for number, batch in enumerate(batches, 1):
            summed.add(batch)
            views = list(batch)  # its pieces' flat views
            yield views + [RUN_CHECKSUM.pack(summed.value())] if number == len(batches) else views
