"""Which slice of the model one tensor-parallel rank holds (TPLayout), and whether a model splits at all.

Query heads, the MLP's intermediate features and the vocabulary are cut into `size` equal ranges, rank r
holding the r-th. KV heads: with at least `size` of them, rank r holds the r-th of `size` equal ranges; with
fewer, each KV head is replicated on size / num_kv_heads consecutive ranks (rank r holds head
r // (size / num_kv_heads)), which are exactly the ranks whose query heads read it (query head h reads KV
head h // (num_heads / num_kv_heads)). The vocabulary need not divide: each rank's range is
ceil(vocab / size) rows, the last one padded with zero rows, and the gathered logits are cut back to vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig

Span = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `size`: the global ranges it holds (heads in head units, the rest in rows/columns)."""

    rank: int
    size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span            # the real vocabulary rows it holds (stop <= vocab_size)
    vocab_per_rank: int    # rows of its embedding / LM head shard, padding included

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def is_sharded(self) -> bool:
        return self.size > 1


def check_tp_shapes(cfg: ModelConfig, size: int) -> None:
    """ValueError, naming the shape, when the model cannot be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads >= size and cfg.num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {cfg.num_kv_heads} KV heads")
    if cfg.num_kv_heads < size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is not a multiple of the model's {cfg.num_kv_heads} KV heads "
                         "(fewer KV heads than ranks are replicated, so the ranks must divide evenly among them)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}")


def tp_layout(cfg: ModelConfig, rank: int, size: int) -> TPLayout:
    """The ranges rank `rank` of `size` holds (check_tp_shapes first: ValueError when the model does not split)."""
    check_tp_shapes(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    heads = cfg.num_heads // size
    inter = cfg.intermediate_size // size
    per_rank = -(-cfg.vocab_size // size)
    vocab_start = min(rank * per_rank, cfg.vocab_size)
    return TPLayout(rank, size, (rank * heads, (rank + 1) * heads), kv_head_span(cfg.num_kv_heads, rank, size),
                    (rank * inter, (rank + 1) * inter), (vocab_start, min(vocab_start + per_rank, cfg.vocab_size)),
                    per_rank)


def kv_head_span(num_kv_heads: int, rank: int, size: int) -> Span:
    """The KV heads rank `rank` of `size` holds in its cache: its equal share, or the one head it replicates."""
    if num_kv_heads >= size:
        share = num_kv_heads // size
        return rank * share, (rank + 1) * share
    head = rank // (size // num_kv_heads)
    return head, head + 1
