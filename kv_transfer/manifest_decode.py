"""decode_manifest: a Manifest from bytes a sender chose, validated before anything the sender sized is built.

A receiver passes its ManifestLimits (its pool's layout and size): the encoding's length, every list's length,
the fingerprint, num_tokens and the number of runs are checked against what the pool could ever hold before
they are built or walked, so a crafted manifest costs O(pool blocks) at most; then the Manifest's own
validation runs (kv_transfer/manifest.py). Any defect is a ManifestError (FingerprintMismatch for a layout
other than the receiver's) with a precise reason.
"""
from __future__ import annotations

from typing import Any

import msgpack

from kv_transfer.manifest import (MANIFEST_VERSION, MAX_MANIFEST_BYTES, MAX_STRING_BYTES, FingerprintMismatch, Manifest,
                                  ManifestError, ManifestLimits, ModelFingerprint, RunInfo, check_int)
from kv_transfer.token_logprobs import MAX_TOP_LOGPROBS, FirstTokenLogprobs, LogprobsError

_TOP_KEYS = {"version", "request_id", "fingerprint", "num_tokens", "block_ids", "first_token", "checksum_algo", "runs"}
_OPTIONAL_TOP_KEYS = {"first_logprobs", "streamed", "prefix_blocks", "kv_heads"}
_FP_KEYS = {"num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"}
_ALL_TOP_KEYS = _TOP_KEYS | _OPTIONAL_TOP_KEYS


def _expect_map(value: Any, keys: set[str], name: str, optional: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{name} must be a map, got {type(value).__name__}")
    present = value.keys()
    if not (keys <= present and (present <= keys or present - keys <= optional)):
        missing, extra = sorted(keys - set(value)), sorted(map(str, set(value) - keys - optional))
        raise ManifestError(f"{name} keys wrong: missing {missing}, unexpected {extra}")
    return value


def _decode_run(i: int, raw: Any) -> RunInfo:
    if not isinstance(raw, list) or len(raw) != 4:
        raise ManifestError(f"runs[{i}] must be [start_block, num_blocks, nbytes, checksum or nil]")
    return RunInfo(*raw)


def _decode_kv_heads(raw: Any) -> tuple | None:
    """A lane's [start, stop] as a tuple (Manifest checks its values), None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 2:
        raise ManifestError(f"kv_heads must be [start, stop], got {raw!r}")
    return tuple(raw)


def _decode_fingerprint(raw: Any, limits: ManifestLimits | None) -> ModelFingerprint:
    """The manifest's fingerprint: the receiver's own (limits.fingerprint, already validated) when the map
    holds exactly its values with exactly their types, else one built (and validated) from the map."""
    fields = _expect_map(raw, _FP_KEYS, "fingerprint")
    if limits is not None and fields == limits.fingerprint.encode() and type(fields["num_layers"]) is int \
            and type(fields["num_kv_heads"]) is int and type(fields["head_dim"]) is int \
            and type(fields["block_size"]) is int:  # equal ints that are not ints: bool or float; a str is a str
        return limits.fingerprint
    return ModelFingerprint(**fields)


def _unpack(data: bytes, limits: ManifestLimits | None) -> Any:
    """msgpack-decodes data; with limits, every list holds at most max(limits.max_blocks, 20) entries (20:
    the first token's logprobs) and the whole encoding fits limits.max_manifest_bytes, checked before (and
    while) anything is built."""
    max_bytes = MAX_MANIFEST_BYTES if limits is None else limits.max_manifest_bytes
    if len(data) > max_bytes:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {max_bytes}"
                            + ("" if limits is None else f" (the most {limits.max_blocks} blocks can take)"))
    max_list = 0 if limits is None else _max_list(limits)
    try:
        if limits is None:
            return msgpack.unpackb(data, raw=False, strict_map_key=True)
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=max_list,
                               max_map_len=len(_ALL_TOP_KEYS), max_str_len=MAX_STRING_BYTES, max_bin_len=0,
                               max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        within = "" if limits is None else f" within this receiver's bounds (lists of at most {max_list} entries)"
        raise ManifestError(f"manifest is not valid msgpack{within}: {exc}") from None


def _max_list(limits: ManifestLimits) -> int:
    """The longest list a manifest within limits holds: its block list, a run, or the first token's logprobs."""
    return max(limits.max_blocks, 4, MAX_TOP_LOGPROBS)


def _check_limits(top: dict, fingerprint: ModelFingerprint, limits: ManifestLimits) -> None:
    """O(1) checks of the sizes the sender chose against what this receiver's pool could ever hold."""
    diff = limits.layout_mismatch(fingerprint)
    if diff:
        raise FingerprintMismatch(f"KV layout differs: {diff}")
    check_int(top["num_tokens"], "num_tokens", minimum=1)
    max_tokens = limits.max_blocks * fingerprint.block_size
    if top["num_tokens"] > max_tokens:
        raise ManifestError(f"num_tokens={top['num_tokens']} exceeds the {max_tokens} tokens this receiver's pool"
                            f" of {limits.max_blocks} blocks could ever hold")
    if len(top["runs"]) > len(top["block_ids"]):
        raise ManifestError(f"{len(top['runs'])} runs for {len(top['block_ids'])} blocks")


def decode_manifest(data: bytes, limits: ManifestLimits | None = None) -> Manifest:
    """Parses and validates manifest bytes; raises ManifestError on anything malformed (FingerprintMismatch
    for a layout other than limits.fingerprint). With limits (a receiver's pool), in this order and before
    anything the size of which the sender chose is built: the encoding's length, every list's length, the
    fingerprint, num_tokens, the number of runs; then the runs' block counts must sum to the block list
    before any run is expanded. Changes nothing."""
    top = _expect_map(_unpack(data, limits), _TOP_KEYS, "manifest", _OPTIONAL_TOP_KEYS)
    if top["version"] != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {top['version']!r} unsupported (expected {MANIFEST_VERSION})")
    if not isinstance(top["block_ids"], list) or not isinstance(top["runs"], list):
        raise ManifestError("block_ids and runs must be lists")
    try:
        fingerprint = _decode_fingerprint(top["fingerprint"], limits)
        if limits is not None:
            _check_limits(top, fingerprint, limits)
        return Manifest(
            request_id=top["request_id"],
            fingerprint=fingerprint,
            num_tokens=top["num_tokens"],
            block_ids=tuple(top["block_ids"]),
            first_token=top["first_token"],
            runs=tuple(_decode_run(i, r) for i, r in enumerate(top["runs"])),
            checksum_algo=top["checksum_algo"],
            first_logprobs=None if "first_logprobs" not in top else FirstTokenLogprobs.decode(top["first_logprobs"]),
            streamed=top.get("streamed", False),
            prefix_blocks=top.get("prefix_blocks", 0),
            kv_heads=_decode_kv_heads(top.get("kv_heads")),
        )
    except LogprobsError as exc:
        raise ManifestError(str(exc)) from None
    except TypeError as exc:
        raise ManifestError(f"manifest field has the wrong type: {exc}") from None
