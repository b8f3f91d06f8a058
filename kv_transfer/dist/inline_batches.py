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


def byte_batches(pieces: list[np.ndarray], row_nbytes: int, first_nbytes: int = BATCH_BYTES) -> list[list[np.ndarray]]:
    """pieces (flat uint8, whole rows: a row is a block of one layer's K or V) in order, cut into batches of at most
    BATCH_BYTES (the first of at most first_nbytes; a batch of one row when a row is larger), a piece that does not
    fit cut at a row boundary. Each batch is summed, then moved in one scatter-gather call while it is still in
    cache; while one side sums a batch, the other moves the one before."""
    batches: list[list[np.ndarray]] = []
    batch: list[np.ndarray] = []
    room = max(first_nbytes, row_nbytes)
    for piece in pieces:
        offset = 0
        while piece.size - offset > room:  # the batch is full before the piece ends: cut it at a row boundary
            take = room // row_nbytes * row_nbytes
            if take:
                batch.append(piece[offset : offset + take])
                offset += take
            batches.append(batch)
            batch, room = [], max(BATCH_BYTES, row_nbytes)
        if offset < piece.size:
            batch.append(piece[offset:] if offset else piece)
            room -= piece.size - offset
    batches.append(batch)
    return batches


def inline_writes(outgoing: OutgoingTransfer) -> Iterator[list]:
    """A whole request's bytes behind its frame, one scatter-gather write at a time: per run, its pieces in
    batches, each summed (in cache) just before it is yielded, the run's checksum behind its last batch. Every
    gather completes before its bytes are yielded."""
    fingerprint = outgoing.manifest.fingerprint
    for index, run in enumerate(outgoing.manifest.runs):
        outgoing.gather(index)
        summed = RunChecksum.of_run(fingerprint, run.num_blocks)
        pieces = outgoing.host_pieces(index)  # flat uint8: the planes, or the gathered run
        batches = byte_batches(pieces, fingerprint.row_nbytes)
        for number, batch in enumerate(batches, 1):
            for piece in batch:
                summed.add(piece)
            yield batch + [RUN_CHECKSUM.pack(summed.value())] if number == len(batches) else batch
