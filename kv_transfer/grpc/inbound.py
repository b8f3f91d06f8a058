"""The receiving end of a Push stream's messages: decode the first one as a manifest, read and land the rest.

Functions of one transfer's messages, shared by the receiver's two stream kinds (a session, a lone Push);
they change only the IncomingTransfer they are given.
"""
from __future__ import annotations

import asyncio

import grpc

from kv_transfer.grpc.codec import DecodedChunk, decode_chunk
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest, ManifestError, ManifestLimits
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.status import KVTransferError, TransferStatus


def decode_first(raw: bytes, limits: ManifestLimits) -> Manifest:
    """A transfer's first message, decoded and checked against the pool's limits (sizes, layout) before
    anything is allocated; KVTransferError(MALFORMED / REJECTED_FINGERPRINT) if it is not acceptable."""
    return manifest_of(_decoded(raw), limits)


def manifest_of(first: DecodedChunk | None, limits: ManifestLimits) -> Manifest:
    """The manifest a transfer's first chunk carries (None: the stream ended), as decode_first."""
    if first is None or first.manifest is None:
        raise KVTransferError(TransferStatus.MALFORMED, "the first chunk must carry the manifest")
    try:
        return decode_manifest(first.manifest, limits)
    except ManifestError as exc:  # MALFORMED, or REJECTED_FINGERPRINT
        raise KVTransferError(exc.status, str(exc)) from None


async def next_chunk(context) -> DecodedChunk | None:
    """The stream's next chunk, None at its end; KVTransferError PEER_FAILED (broken) or MALFORMED."""
    try:
        raw = await context.read()
    except grpc.aio.AioRpcError as exc:
        raise KVTransferError(TransferStatus.PEER_FAILED, f"stream broke: {exc.code().name}") from None
    return None if raw is grpc.aio.EOF else _decoded(raw)


def _decoded(raw: bytes) -> DecodedChunk:
    try:
        return decode_chunk(raw)
    except ValueError as exc:
        raise KVTransferError(TransferStatus.MALFORMED, str(exc)) from None


def land_chunk(incoming: IncomingTransfer, chunk: DecodedChunk) -> None:
    """Hands one chunk after the manifest to the transfer (see IncomingTransfer.write, run_checksum and
    set_tail); KVTransferError(MALFORMED) for a chunk that carries none of those."""
    if chunk.data is not None:
        incoming.write(chunk.data)
    elif chunk.run_checksum is not None:
        incoming.run_checksum(chunk.run_checksum)
    elif chunk.tail is not None:
        incoming.set_tail(chunk.tail)
    else:
        raise KVTransferError(TransferStatus.MALFORMED, "a chunk after the first must carry data, a run checksum or "
                              "a tail", incoming.manifest.request_id)


def arrived(incoming: IncomingTransfer) -> bool:
    """Whether the transfer's last message is in: every run's bytes and trailing checksum, and a layer-streamed
    transfer's tail (its first token). In a session the next message belongs to the next transfer."""
    return incoming.complete and incoming.manifest.first_token is not None


async def drain(context, timeout_s: float) -> None:
    """Reads and drops what the client still sends until it half-closes or cancels (at most timeout_s), so a
    client still writing sees the final ack first."""
    async def until_eof() -> None:
        while await context.read() is not grpc.aio.EOF:
            pass
    try:
        await asyncio.wait_for(until_eof(), timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
