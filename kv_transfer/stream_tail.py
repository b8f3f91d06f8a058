"""A layer-streamed transfer's tail: the first token (and its logprobs), sent after the last layer because
the step samples it only after the forward that streamed the layers."""
from __future__ import annotations

from dataclasses import replace

import msgpack

from kv_transfer.manifest import Manifest, ManifestError, check_int
from kv_transfer.token_logprobs import MAX_TOP_LOGPROBS, FirstTokenLogprobs, LogprobsError

MAX_TAIL_BYTES = 4096


def encode_tail(first_token: int, first_logprobs: FirstTokenLogprobs | None) -> bytes:
    """A streamed transfer's tail: msgpack [first_token, first_logprobs or nil]."""
    return msgpack.packb([first_token, None if first_logprobs is None else first_logprobs.encode()])


def decode_tail(data: bytes) -> tuple[int, FirstTokenLogprobs | None]:
    """Parses a tail (at most MAX_TAIL_BYTES); ManifestError on anything malformed."""
    if len(data) > MAX_TAIL_BYTES:
        raise ManifestError(f"tail of {len(data)} bytes exceeds {MAX_TAIL_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, max_array_len=MAX_TOP_LOGPROBS, max_map_len=0, max_bin_len=0,
                              max_ext_len=0, max_str_len=0)
    except Exception as exc:
        raise ManifestError(f"tail is not valid msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) != 2:
        raise ManifestError("tail must be [first_token, first_logprobs or nil]")
    check_int(raw[0], "tail.first_token")
    try:
        return raw[0], None if raw[1] is None else FirstTokenLogprobs.decode(raw[1])
    except LogprobsError as exc:
        raise ManifestError(str(exc)) from None


def complete_manifest(manifest: Manifest, tail: bytes) -> Manifest:
    """The streamed manifest completed by its tail; ManifestError if the tail is malformed or none is due."""
    if not manifest.streamed or manifest.first_token is not None:
        raise ManifestError("a tail where none is due")
    first_token, first_logprobs = decode_tail(tail)
    return replace(manifest, first_token=first_token, first_logprobs=first_logprobs)
