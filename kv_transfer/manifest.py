"""The wire manifest of one KV transfer: what the receiver must allocate and how to verify it.

Encoded with msgpack as a map with string keys (encode_manifest). A Manifest validates every field and the
consistency of runs, blocks and byte lengths on construction, and raises ManifestError with a precise
reason. Reading one from untrusted bytes, bounded by the receiver's ManifestLimits, is
kv_transfer/manifest_decode.py.
With prefix_blocks = k > 0 the receiver already holds the prompt's first k blocks (it matched them in its
prefix cache and pinned them): block_ids and runs cover only the prompt's blocks after them, at least one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

import msgpack

from kv_transfer.checksum import CHECKSUM_ALGO
from kv_transfer.status import TransferStatus
from kv_transfer.token_logprobs import FirstTokenLogprobs

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
MAX_STRING_BYTES = 2048  # request_id is at most 512 characters: 2048 bytes of UTF-8
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_U64 = 1 << 64
# The longest encoding of a manifest within ManifestLimits: the map, its keys, three strings, the scalars and
# the first token's logprobs (at most 20 ids and floats, < 400 bytes),
# plus per block a uint64 id and at most one run of one block (array header, three uint64, a uint64 checksum).
_FIXED_BYTES = 8 << 10
_BYTES_PER_BLOCK = 9 + 1 + 4 * 9


class ManifestError(ValueError):
    """A manifest that cannot be decoded or is inconsistent; status is what the receiver answers."""

    status = TransferStatus.MALFORMED


class FingerprintMismatch(ManifestError):
    """A well-formed manifest for a KV layout other than the receiver's pool."""

    status = TransferStatus.REJECTED_FINGERPRINT


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
            check_int(getattr(self, name), f"fingerprint.{name}", minimum=1)
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ManifestError(f"fingerprint.dtype {self.dtype!r} not in {sorted(DTYPE_ITEMSIZE)}")

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V (computed once: the fingerprint is frozen)."""
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @cached_property
    def row_nbytes(self) -> int:
        """Bytes of one row: one block of one layer's K or V (a plane of one block)."""
        return self.block_nbytes // (2 * self.num_layers)

    def mismatch(self, other: "ModelFingerprint") -> str | None:
        """A readable description of how `other` differs from self, or None if they match."""
        if other is self or other == self:  # the common case, without building the description
            return None
        diffs = [f"{k}: {v} != {getattr(other, k)}" for k, v in asdict(self).items() if v != getattr(other, k)]
        return "; ".join(diffs) or None

    def encode(self) -> dict:
        """The fingerprint as the manifest's map."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "block_size": self.block_size}


@dataclass(frozen=True)
class ManifestLimits:
    """What a receiver could ever accept: its pool's KV layout and its size in blocks (the whole pool, free
    or not). decode_manifest(data, limits) refuses anything beyond them before building it. window_heads: the
    pool's KV heads when it also takes a transfer of fewer of them (a lane's part): the layout may then differ
    in num_kv_heads, by holding fewer."""

    fingerprint: ModelFingerprint
    max_blocks: int
    window_heads: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_int(self.max_blocks, "max_blocks", minimum=1)

    def layout_mismatch(self, fingerprint: ModelFingerprint) -> str | None:
        """How fingerprint differs from what this receiver takes (None: it takes it)."""
        diff = self.fingerprint.mismatch(fingerprint)
        if diff and self.window_heads is not None and 0 < fingerprint.num_kv_heads < self.fingerprint.num_kv_heads:
            return self.fingerprint.mismatch(replace(fingerprint, num_kv_heads=self.fingerprint.num_kv_heads))
        return diff

    @property
    def max_manifest_bytes(self) -> int:
        """The most bytes a manifest of at most max_blocks blocks can take (capped by MAX_MANIFEST_BYTES)."""
        return min(MAX_MANIFEST_BYTES, _FIXED_BYTES + self.max_blocks * _BYTES_PER_BLOCK)


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
    first_token: int | None  # None only while a streamed transfer's tail has not arrived
    runs: tuple[RunInfo, ...]
    checksum_algo: str = CHECKSUM_ALGO
    first_logprobs: FirstTokenLogprobs | None = None  # when the request asked for logprobs
    streamed: bool = False  # layer-streamed: pieces are layers, checksums trail them, the first token comes last
    prefix_blocks: int = 0  # leading prompt blocks the receiver already holds: block_ids cover the rest
    kv_heads: tuple[int, int] | None = None  # the model's KV heads [start, stop) the blocks hold (a lane); None: all

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def total_nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    @property
    def piece_nbytes(self) -> list[int]:
        """Bytes of each piece in wire order: a run each, or (streamed) one layer of every block each."""
        if self.streamed:
            return [self.total_nbytes // self.fingerprint.num_layers] * self.fingerprint.num_layers
        return [run.nbytes for run in self.runs]

    @property
    def trailing_checksums(self) -> bool:
        """Whether some run's checksum follows its bytes instead of travelling in the manifest."""
        return any(run.checksum is None for run in self.runs)


def check_int(value: Any, name: str, minimum: int = 0, limit: int = _U64) -> None:
    """ManifestError unless value is an int (not a bool) in [minimum, limit)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value < limit:
        raise ManifestError(f"{name}={value} outside [{minimum}, {limit})")


def _validate(m: Manifest) -> None:
    """O(blocks), and no run is expanded before the runs' block counts are known to sum to the block list. The
    per-block checks build an error's name only for a block that fails (a transfer's fixed cost: issue 28)."""
    if not isinstance(m.request_id, str) or not 0 < len(m.request_id) <= 512:
        raise ManifestError("request_id must be a non-empty string of at most 512 characters")
    check_int(m.num_tokens, "num_tokens", minimum=1)
    if not isinstance(m.streamed, bool):
        raise ManifestError(f"streamed must be a bool, got {type(m.streamed).__name__}")
    if m.first_token is not None or not m.streamed:  # a streamed manifest leaves it to the tail
        check_int(m.first_token, "first_token")
    if m.streamed and any(run.checksum is not None for run in m.runs):
        raise ManifestError("a streamed manifest carries no run checksums (each layer's trails it)")
    if m.checksum_algo != CHECKSUM_ALGO:
        raise ManifestError(f"unknown checksum_algo {m.checksum_algo!r}")
    if m.kv_heads is not None:
        _validate_kv_heads(m.kv_heads, m.fingerprint.num_kv_heads)
    prompt_blocks = -(-m.num_tokens // m.fingerprint.block_size)
    check_int(m.prefix_blocks, "prefix_blocks", limit=prompt_blocks)  # at least the last block travels
    expected_blocks = prompt_blocks - m.prefix_blocks
    if len(m.block_ids) != expected_blocks:
        held = f" ({m.prefix_blocks} held by the receiver)" if m.prefix_blocks else ""
        raise ManifestError(f"{m.num_tokens} tokens need {expected_blocks} blocks{held}, "
                            f"manifest lists {len(m.block_ids)}")
    if not all(type(block) is int and 0 <= block < _U64 for block in m.block_ids):  # else: which one, and why
        for i, block in enumerate(m.block_ids):
            check_int(block, f"block_ids[{i}]")
    if len(set(m.block_ids)) != len(m.block_ids):
        raise ManifestError("block_ids contain duplicates")
    _validate_runs(m)


def _validate_kv_heads(kv_heads: Any, num_kv_heads: int) -> None:
    """ManifestError unless kv_heads is a (start, stop) of ints spanning exactly the fingerprint's num_kv_heads."""
    if not isinstance(kv_heads, tuple) or len(kv_heads) != 2:
        raise ManifestError(f"kv_heads must be (start, stop), got {kv_heads!r}")
    check_int(kv_heads[0], "kv_heads[0]", limit=1 << 16)
    check_int(kv_heads[1], "kv_heads[1]", limit=1 << 16)
    if kv_heads[1] - kv_heads[0] != num_kv_heads:
        raise ManifestError(f"kv_heads {kv_heads} do not span the fingerprint's {num_kv_heads} KV heads")


def _validate_runs(m: Manifest) -> None:
    if not m.runs:
        raise ManifestError("manifest has no runs")
    total = 0
    for i, run in enumerate(m.runs):  # O(runs): sizes first, nothing expanded
        check_int(run.start_block, f"runs[{i}].start_block")
        check_int(run.num_blocks, f"runs[{i}].num_blocks", minimum=1)
        if run.checksum is not None:
            check_int(run.checksum, f"runs[{i}].checksum")
        if run.nbytes != run.num_blocks * m.fingerprint.block_nbytes:
            raise ManifestError(f"runs[{i}].nbytes={run.nbytes} != {run.num_blocks} blocks * "
                                f"{m.fingerprint.block_nbytes}")
        total += run.num_blocks
        if total > len(m.block_ids):
            raise ManifestError(f"runs[..{i}] already cover {total} blocks, manifest lists {len(m.block_ids)}")
    if total != len(m.block_ids):
        raise ManifestError(f"runs cover {total} blocks, manifest lists {len(m.block_ids)}")
    first = 0
    for run in m.runs:  # the counts sum to len(block_ids): this walks each listed block once
        expected = tuple(range(run.start_block, run.start_block + run.num_blocks))
        if m.block_ids[first : first + run.num_blocks] != expected:
            raise ManifestError("runs do not cover block_ids exactly and in order")
        first += run.num_blocks


def encode_manifest(m: Manifest) -> bytes:
    """msgpack bytes of a (valid) manifest; first_logprobs and prefix_blocks only when set."""
    top = {
        "version": MANIFEST_VERSION,
        "request_id": m.request_id,
        "fingerprint": m.fingerprint.encode(),
        "num_tokens": m.num_tokens,
        "block_ids": m.block_ids,  # a tuple packs as the same msgpack array as a list
        "first_token": m.first_token,
        "checksum_algo": m.checksum_algo,
        "runs": [(r.start_block, r.num_blocks, r.nbytes, r.checksum) for r in m.runs],
    }
    if m.first_logprobs is not None:
        top["first_logprobs"] = m.first_logprobs.encode()
    if m.streamed:
        top["streamed"] = True
    if m.prefix_blocks:
        top["prefix_blocks"] = m.prefix_blocks
    if m.kv_heads is not None:
        top["kv_heads"] = m.kv_heads
    return msgpack.packb(top)
