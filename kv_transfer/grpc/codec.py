"""Wire encoding of the KVTransfer.Push stream without protobuf copies of the KV bytes.

The stream's messages are tandem.v1.KVChunk. A data chunk is encoded by hand as the exact protobuf
wire bytes of KVChunk(data=...) (field 2, length-delimited), which costs one copy instead of three;
the server parses that form directly and falls back to protobuf for any other valid encoding.
Method names come from the proto descriptor, never from string literals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from proto import tandem_pb2

_SERVICE = tandem_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
_PUSH = _SERVICE.methods_by_name["Push"]
SERVICE_NAME = _SERVICE.full_name  # tandem.v1.KVTransfer
PUSH_METHOD = _PUSH.name  # Push
PUSH_PATH = f"/{SERVICE_NAME}/{PUSH_METHOD}"
_DATA_TAG = (tandem_pb2.KVChunk.DATA_FIELD_NUMBER << 3) | 2  # length-delimited field 2 -> 0x12


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options for bulk KV streams (measured with kv_transfer/bench.py)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_data_chunk(data: memoryview | Sequence[memoryview]) -> bytes:
    """Wire bytes of KVChunk(data=...) whose payload is data (or the concatenation of its parts), built
    with a single copy of the payload."""
    parts = [data] if isinstance(data, memoryview) else list(data)
    size = sum(part.nbytes for part in parts)
    return b"".join([bytes((_DATA_TAG,)), _varint(size), *parts])


def chunk_parts(pieces: Iterable[memoryview], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """Splits the concatenation of flat byte pieces into consecutive chunks of chunk_bytes (the last one
    shorter), each given as the slices of the pieces it spans; copies nothing."""
    parts: list[memoryview] = []
    size = 0
    for piece in pieces:
        offset = 0
        while offset < piece.nbytes:
            take = min(chunk_bytes - size, piece.nbytes - offset)
            parts.append(piece[offset : offset + take])
            size, offset = size + take, offset + take
            if size == chunk_bytes:
                yield parts
                parts, size = [], 0
    if parts:
        yield parts


def encode_manifest_chunk(manifest_bytes: bytes) -> bytes:
    return tandem_pb2.KVChunk(manifest=manifest_bytes).SerializeToString()


def encode_checksum_chunk(checksum: int) -> bytes:
    """Wire bytes of KVChunk(run_checksum=...): the trailing checksum of the run whose bytes just ended."""
    return tandem_pb2.KVChunk(run_checksum=checksum).SerializeToString()


def encode_tail_chunk(tail: bytes) -> bytes:
    """Wire bytes of KVChunk(tail=...): a layer-streamed transfer's first token, after its last layer."""
    return tandem_pb2.KVChunk(tail=tail).SerializeToString()


@dataclass(frozen=True)
class DecodedChunk:
    """One KVChunk: at most one of manifest / data / run_checksum / tail is set (none: an empty chunk)."""

    manifest: bytes | None
    data: memoryview | None
    run_checksum: int | None = None
    tail: bytes | None = None


def _parse_fast_data(raw: bytes) -> memoryview | None:
    """The data payload if raw is exactly tag 0x12, a varint length and that many bytes; else None."""
    if not raw or raw[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(raw) and pos <= 10:
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return memoryview(raw)[pos:] if pos + length == len(raw) else None
    return None


def decode_chunk(raw: bytes) -> DecodedChunk:
    """Parses one KVChunk; raises ValueError if raw is not a valid KVChunk encoding."""
    data = _parse_fast_data(raw)
    if data is not None:
        return DecodedChunk(None, data)
    try:
        chunk = tandem_pb2.KVChunk.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"not a KVChunk: {exc}") from None
    kind = chunk.WhichOneof("payload")
    if kind == "manifest":
        return DecodedChunk(chunk.manifest, None)
    if kind == "run_checksum":
        return DecodedChunk(None, None, chunk.run_checksum)
    if kind == "tail":
        return DecodedChunk(None, None, tail=chunk.tail)
    return DecodedChunk(None, memoryview(chunk.data) if kind == "data" else None)
