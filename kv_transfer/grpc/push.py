"""The messages of one transfer on a Push stream, sender side: the manifest, then every piece's bytes in
chunks, each piece followed by its checksum unless the manifest carries it, then a streamed transfer's tail.

Two ways, chosen per transfer by the sender (`is_small`):
- small (a CPU pool, a whole request of at most SMALL_TRANSFER_BYTES): the checksums were taken into the
  manifest and each run is gathered on the loop thread: the manifest and the data chunks, no thread hop;
- otherwise: the manifest leaves before any checksum is taken; piece i+1 is gathered (when it is not
  direct; a streamed layer once the step wrote it) and checksummed on the default executor while piece i
  streams, and its checksum trails its bytes.
"""
from __future__ import annotations

import asyncio
from collections import Counter

from kv_transfer.grpc.codec import (chunk_parts, encode_checksum_chunk, encode_data_chunk, encode_manifest_chunk,
                                    encode_tail_chunk)
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest

SMALL_TRANSFER_BYTES = 2 << 20  # at most this much: checksums in the manifest, no executor hop on either side


def is_small(pool: KVPoolView, nbytes: int, streamed: bool) -> bool:
    """Whether a transfer of nbytes from (or into) pool takes the small way (see the module docstring)."""
    return not streamed and pool.on_host and nbytes <= SMALL_TRANSFER_BYTES


def request_nbytes(pool: KVPoolView, request: SendRequest) -> int:
    return len(request.block_ids) * pool.fingerprint.block_nbytes


class PipelinedWriter:
    """Writes messages to a call one at a time, handing message k+1 to gRPC only after message k was
    taken, so the caller can build k+1 while k is sent; stops writing once `final` (the receiver's final
    ack) has arrived. Counts each message by kind in `counts`."""

    def __init__(self, call, final: asyncio.Future, counts: Counter):
        self.call, self.final, self.counts = call, final, counts
        self.writing: asyncio.Future | None = None

    async def write(self, kind: str, message: bytes) -> bool:
        """Queues message after the previous one; False (nothing written) once the final ack is in."""
        await self.flush()
        if self.final.done():
            return False
        self.writing = asyncio.ensure_future(self.call.write(message))
        self.counts[kind] += 1
        await asyncio.sleep(0)  # let the write hand the message to gRPC before the caller builds the next
        return True

    async def write_now(self, kind: str, message: bytes) -> bool:
        """Writes message and waits until gRPC took it; False (nothing written) once the final ack is in."""
        if self.final.done():
            return False
        self.counts[kind] += 1
        await self.call.write(message)
        return True

    async def flush(self) -> None:
        if self.writing is not None:
            await self.writing

    async def abandon(self) -> None:
        """Cancels a write still in flight (the message is our own copy; the call is failing anyway)."""
        if self.writing is None:
            return
        if not self.writing.done():
            self.writing.cancel()
        await asyncio.wait([self.writing])
        if not self.writing.cancelled():
            self.writing.exception()  # retrieved: the error that ended the call is reported elsewhere


async def write_manifest(writer: PipelinedWriter, outgoing: OutgoingTransfer) -> bool:
    """Writes the transfer's first message and waits until gRPC took it (a stream that had already ended
    raises here, before any byte of the transfer left: see GrpcSender._exchange)."""
    return await writer.write_now("manifest", encode_manifest_chunk(outgoing.manifest_bytes))


async def write_transfer(writer: PipelinedWriter, outgoing: OutgoingTransfer, chunk_bytes: int, small: bool) -> bool:
    """Writes every message of the transfer after its manifest. True when all went out; False when the final
    ack arrived first (the receiver gave up: the stream is not reused). Nothing reads the pool or staging
    once it returns or raises."""
    try:
        if small:
            return await _write_small(writer, outgoing, chunk_bytes)
        return await _write_trailing(writer, outgoing, chunk_bytes)
    finally:
        await writer.abandon()


async def _write_small(writer: PipelinedWriter, outgoing: OutgoingTransfer, chunk_bytes: int) -> bool:
    """Gathers and writes on this thread, each write awaited in place (nothing to overlap it with)."""
    for index in range(outgoing.num_pieces):
        outgoing.gather(index)  # a no-op for a direct run; a small CPU copy otherwise
        _, pieces = outgoing.host_pieces(index)  # flat memoryviews
        for parts in chunk_parts(pieces, chunk_bytes):
            if not await writer.write_now("data", encode_data_chunk(parts)):
                return False
    return True


async def _write_trailing(writer: PipelinedWriter, outgoing: OutgoingTransfer, chunk_bytes: int) -> bool:
    summing, gathering = checksum_soon(outgoing, 0), gather_soon(outgoing, 0)  # while the manifest travels
    try:
        for index in range(outgoing.num_pieces):
            await gathering
            if index + 1 < outgoing.num_pieces:
                gathering = gather_soon(outgoing, index + 1)
            _, pieces = outgoing.host_pieces(index)  # flat memoryviews
            for parts in chunk_parts(pieces, chunk_bytes):
                if not await writer.write("data", encode_data_chunk(parts)):  # encoded while the previous one sends
                    return False
            checksum = await summing
            if index + 1 < outgoing.num_pieces:
                summing = checksum_soon(outgoing, index + 1)
            if not await writer.write("run_checksum", encode_checksum_chunk(checksum)):
                return False
        if outgoing.stream is not None:
            tail = await asyncio.get_running_loop().run_in_executor(None, outgoing.tail)
            if not await writer.write("tail", encode_tail_chunk(tail)):
                return False
        await writer.flush()
        return True
    finally:  # staging is released after we return: no gather may still be writing into it
        await writer.abandon()
        await asyncio.wait([gathering, summing])
        for future in (gathering, summing):  # their errors (a stream that stopped) are reported elsewhere
            if not future.cancelled():
                future.exception()


def gather_soon(outgoing: OutgoingTransfer, index: int) -> asyncio.Future:
    """Starts gathering run `index` on the default executor; a finished future for a direct run, which
    travels from the pool as it is (no thread hop)."""
    loop = asyncio.get_running_loop()
    if outgoing.direct[index]:
        done = loop.create_future()
        done.set_result(None)
        return done
    return loop.run_in_executor(None, outgoing.gather, index)


def checksum_soon(outgoing: OutgoingTransfer, index: int) -> asyncio.Future:
    """Starts checksumming run `index` (from the sender's pool) on the default executor."""
    return asyncio.get_running_loop().run_in_executor(None, outgoing.checksum, index)
