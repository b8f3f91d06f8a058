"""AttentionMetadata: where each batch token's K/V goes and what each query attends to.

Built once per step from the scheduled chunks (ModelRunner.prepare) and read by every layer. The batch is
token-major and sequence-ordered: sequences [0, num_decode_rows) are single-token queries (decodes, and
prompt chunks of one token), one row each; then each prefill chunk occupies a contiguous row span.
Per-token tensors (positions, slot mapping) are computed on the device from per-sequence tensors; no
Python loop runs over tokens or context positions.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class PagedAttention(Protocol):
    """What a step's metadata needs of its attention backend (engine/attention/backends.py implements it):
    store this step's K/V into the pool, then attend (forward), or attend over K/V the layer stored itself
    (attend). fused_layers: the layers use their fused Triton kernels (engine/model/fused_triton.py: RoPE with
    the K/V store, RMSNorm with the residual add, SiLU x up). Declared here so the metadata and the backends do
    not import each other."""

    fused_layers: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def store(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              slot_mapping: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs; device tensors plus the few host numbers that size kernel grids."""

    backend: PagedAttention
    slot_mapping: torch.Tensor   # [T] int64 pool slot of each batch token
    query_start: torch.Tensor    # [N + 1] int32 first row of each sequence (cu_seqlens)
    seq_lens: torch.Tensor       # [N] int32 tokens in each sequence's context after this step
    block_tables: torch.Tensor   # [N, max_blocks] int32, 0-padded
    block_size: int
    num_decode_rows: int         # sequences (= rows) [0, num_decode_rows) are single-token queries
    query_start_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # An upper bound of the decode rows' seq_lens (sizes the decode kernel's grid): their maximum, or
    # max_model_len in a captured decode graph, whose lengths change from replay to replay.
    decode_len_bound: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @functools.cached_property  # read by every layer's attention: counted once a step
    def max_prefill_query_len(self) -> int:
        starts = self.query_start_host
        return max((starts[i + 1] - starts[i] for i in range(self.num_decode_rows, self.num_seqs)), default=0)


@dataclass(frozen=True)
class StepTensors:
    """What ModelRunner.prepare builds: the flat batch's inputs and its attention metadata."""

    positions: torch.Tensor      # [T] int64
    meta: AttentionMetadata


def build_step_tensors(backend: PagedAttention, num_computed: list[int], num_new: list[int],
                       block_tables: np.ndarray, block_size: int, device: torch.device) -> StepTensors:
    """Positions, slot mapping and metadata for sequences whose chunks cover positions
    [num_computed[i], num_computed[i] + num_new[i]); single-token chunks come first. block_tables:
    [N, max_blocks] int32, each row holding at least the blocks of positions up to its chunk's end. Uploads
    its inputs itself (tensor-parallel followers); rank 0's runner stages them in one copy and calls
    `step_tensors`."""
    query_start = query_starts(num_new)
    tables = _upload(block_tables, device)                                          # [N, max_blocks]
    starts = _upload(np.asarray(query_start, dtype=np.int32), device)               # [N + 1]
    computed = _upload(np.asarray(num_computed, dtype=np.int64), device)            # [N]
    new = _upload(np.asarray(num_new, dtype=np.int64), device)                      # [N]
    seq_lens = [c + n for c, n in zip(num_computed, num_new)]
    lens = _upload(np.asarray(seq_lens, dtype=np.int32), device)                    # [N]
    return step_tensors(backend, StepCounts(computed, new, starts, lens), tables, tuple(query_start),
                        tuple(seq_lens), block_size)


@dataclass(frozen=True)
class StepCounts:
    """A step's per-sequence counts on the device."""

    num_computed: torch.Tensor   # [N] int64
    num_new: torch.Tensor        # [N] int64
    query_start: torch.Tensor    # [N + 1] int32
    seq_lens: torch.Tensor       # [N] int32


def step_tensors(backend: PagedAttention, counts: StepCounts, tables: torch.Tensor, query_start: tuple[int, ...],
                 seq_lens: tuple[int, ...], block_size: int) -> StepTensors:
    """Positions and slot mapping computed on the device from the per-sequence counts and the step's tables
    [N, width] int32, and the metadata around them; query_start / seq_lens: the same counts on the host."""
    num_tokens, device = query_start[-1], tables.device
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), counts.num_new,
                                           output_size=num_tokens)                 # [T]
    offset_in_chunk = torch.arange(num_tokens, device=device) - counts.query_start.long()[seq_of_token]
    positions = counts.num_computed[seq_of_token] + offset_in_chunk                # [T]
    blocks = tables[seq_of_token, positions // block_size].long()                  # [T]
    slot_mapping = blocks * block_size + positions % block_size                    # [T]
    starts = query_start
    num_decode_rows = next((i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] > 1), len(seq_lens))
    meta = AttentionMetadata(backend, slot_mapping, counts.query_start, counts.seq_lens, tables, block_size,
                             num_decode_rows, query_start, seq_lens, max(seq_lens[:num_decode_rows], default=0))
    return StepTensors(positions, meta)


def query_starts(num_new: list[int]) -> list[int]:
    """[N + 1]: the first batch row of each sequence, then the batch's token count (cu_seqlens)."""
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    return starts


def padded_tables(tables: list[list[int]]) -> np.ndarray:
    """Block-table lists as one [N, longest] int32 array, 0-padded (tests and checks; the runner keeps
    incremental mirrors instead, engine/attention/block_tables.py)."""
    out = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out


def table_width(seq_lens: list[int], block_size: int) -> int:
    """Blocks of the longest context: the width of the step's block tables."""
    return max(-(-length // block_size) for length in seq_lens)


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(host)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
