"""The wire manifest of one KV transfer: what the receiver must allocate and how to verify it.

Encoded with msgpack as a map with string keys. decode_manifest validates every field and the
consistency of runs, blocks and byte lengths, and raises ManifestError with a precise reason.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from kv_transfer.checksum import CHECKSUM_ALGO

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_U64 = 1 << 64


class ManifestError(ValueError):
    """A manifest that cannot be decoded or is inconsistent."""


@dataclass(frozen=True)
class ModelFingerprint:
    """The KV layout both pools must share for blocks to be copied byte for byte."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _check_int(getattr(self, name), f"fingerprint.{name}", minimum=1)
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ManifestError(f"fingerprint.dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: "ModelFingerprint") -> str | None:
        """A readable description of how `other` differs from self, or None if they match."""
        diffs = [f"{k}: {v} != {getattr(other, k)}" for k, v in asdict(self).items() if v != getattr(other, k)]
        return "; ".join(diffs) or None


@dataclass(frozen=True)
class RunInfo:
    """A run of consecutive sender blocks moved as one piece: [L, 2, num_blocks, block_size, H, D].

    checksum None: the transport sends it right after the run's bytes (gRPC's run_checksum chunk), so the
    sender checksums a run while the previous one is on the wire instead of all of them up front."""

    start_block: int
    num_blocks: int
    nbytes: int
    checksum: int | None


@dataclass(frozen=True)
class Manifest:
    """Everything the receiver needs before the bytes arrive; validated on construction."""

    request_id: str
    fingerprint: ModelFingerprint
    num_tokens: int
    block_ids: tuple[int, ...]
    first_token: int
    runs: tuple[RunInfo, ...]
    checksum_algo: str = CHECKSUM_ALGO

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def total_nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    @property
    def trailing_checksums(self) -> bool:
        """Whether some run's checksum follows its bytes instead of travelling in the manifest."""
        return any(run.checksum is None for run in self.runs)


def _check_int(value: Any, name: str, minimum: int = 0, limit: int = _U64) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value < limit:
        raise ManifestError(f"{name}={value} outside [{minimum}, {limit})")


def _validate(m: Manifest) -> None:
    if not isinstance(m.request_id, str) or not 0 < len(m.request_id) <= 512:
        raise ManifestError("request_id must be a non-empty string of at most 512 characters")
    _check_int(m.num_tokens, "num_tokens", minimum=1)
    _check_int(m.first_token, "first_token")
    if m.checksum_algo != CHECKSUM_ALGO:
        raise ManifestError(f"unknown checksum_algo {m.checksum_algo!r}")
    for i, block in enumerate(m.block_ids):
        _check_int(block, f"block_ids[{i}]")
    expected_blocks = -(-m.num_tokens // m.fingerprint.block_size)
    if len(m.block_ids) != expected_blocks:
        raise ManifestError(f"{m.num_tokens} tokens need {expected_blocks} blocks, manifest lists {len(m.block_ids)}")
    if len(set(m.block_ids)) != len(m.block_ids):
        raise ManifestError("block_ids contain duplicates")
    _validate_runs(m)


def _validate_runs(m: Manifest) -> None:
    if not m.runs:
        raise ManifestError("manifest has no runs")
    covered: list[int] = []
    for i, run in enumerate(m.runs):
        _check_int(run.start_block, f"runs[{i}].start_block")
        _check_int(run.num_blocks, f"runs[{i}].num_blocks", minimum=1)
        if run.checksum is not None:
            _check_int(run.checksum, f"runs[{i}].checksum")
        if run.nbytes != run.num_blocks * m.fingerprint.block_nbytes:
            raise ManifestError(f"runs[{i}].nbytes={run.nbytes} != {run.num_blocks} blocks * {m.fingerprint.block_nbytes}")
        covered.extend(range(run.start_block, run.start_block + run.num_blocks))
    if tuple(covered) != tuple(m.block_ids):
        raise ManifestError("runs do not cover block_ids exactly and in order")


def encode_manifest(m: Manifest) -> bytes:
    """msgpack bytes of a (valid) manifest."""
    return msgpack.packb({
        "version": MANIFEST_VERSION,
        "request_id": m.request_id,
        "fingerprint": asdict(m.fingerprint),
        "num_tokens": m.num_tokens,
        "block_ids": list(m.block_ids),
        "first_token": m.first_token,
        "checksum_algo": m.checksum_algo,
        "runs": [[r.start_block, r.num_blocks, r.nbytes, r.checksum] for r in m.runs],
    })


_TOP_KEYS = {"version", "request_id", "fingerprint", "num_tokens", "block_ids", "first_token", "checksum_algo", "runs"}
_FP_KEYS = {"num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"}


def _expect_map(value: Any, keys: set[str], name: str) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{name} must be a map, got {type(value).__name__}")
    if set(value) != keys:
        missing, extra = sorted(keys - set(value)), sorted(map(str, set(value) - keys))
        raise ManifestError(f"{name} keys wrong: missing {missing}, unexpected {extra}")
    return value


def _decode_run(i: int, raw: Any) -> RunInfo:
    if not isinstance(raw, list) or len(raw) != 4:
        raise ManifestError(f"runs[{i}] must be [start_block, num_blocks, nbytes, checksum or nil]")
    return RunInfo(*raw)


def decode_manifest(data: bytes) -> Manifest:
    """Parses and validates manifest bytes; raises ManifestError on anything malformed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ManifestError(f"manifest is not valid msgpack: {exc}") from None
    top = _expect_map(raw, _TOP_KEYS, "manifest")
    if top["version"] != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {top['version']!r} unsupported (expected {MANIFEST_VERSION})")
    if not isinstance(top["block_ids"], list) or not isinstance(top["runs"], list):
        raise ManifestError("block_ids and runs must be lists")
    try:
        return Manifest(
            request_id=top["request_id"],
            fingerprint=ModelFingerprint(**_expect_map(top["fingerprint"], _FP_KEYS, "fingerprint")),
            num_tokens=top["num_tokens"],
            block_ids=tuple(top["block_ids"]),
            first_token=top["first_token"],
            runs=tuple(_decode_run(i, r) for i, r in enumerate(top["runs"])),
            checksum_algo=top["checksum_algo"],
        )
    except TypeError as exc:
        raise ManifestError(f"manifest field has the wrong type: {exc}") from None
