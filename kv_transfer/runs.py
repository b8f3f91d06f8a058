"""Contiguous runs of block ids, and moving them between a KV pool and flat staging bytes.

A run kv[:, :, start:start+n] is strided in the pool; it is gathered into one contiguous staging
piece [num_layers, 2, n, block_size, H, D] (layer-major, K then V) and moved as one message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kv_transfer.host_copy import copy_tensor
from kv_transfer.manifest import ModelFingerprint
from kv_transfer.pool import TORCH_DTYPES, HostPieces

STAGING_ALIGN = 64


@dataclass(frozen=True)
class BlockRun:
    """num_blocks consecutive block ids starting at start."""

    start: int
    num_blocks: int


def consecutive_start(ids: Sequence[int]) -> int | None:
    """ids[0] when ids (at least one) are consecutive ascending ids, else None. Reads only the ends of a
    list that is plainly not consecutive."""
    first, n = ids[0], len(ids)
    if ids[-1] - first != n - 1 or tuple(ids) != tuple(range(first, first + n)):
        return None
    return first


def group_runs(block_ids: Sequence[int], max_blocks: int = 0) -> list[BlockRun]:
    """Splits block ids, in order, into runs of consecutive ascending ids of at most max_blocks each
    (0: unbounded). Bounded runs let gather, wire and scatter of neighbouring runs overlap."""
    runs: list[BlockRun] = []
    start = previous = None
    count = 0
    for block in block_ids:  # one BlockRun per run, made once the run ends
        if count and previous + 1 == block and (not max_blocks or count < max_blocks):
            count += 1
        else:
            if count:
                runs.append(BlockRun(start, count))
            start, count = block, 1
        previous = block
    if count:
        runs.append(BlockRun(start, count))
    return runs


def staging_offsets(nbytes_per_run: Sequence[int]) -> tuple[list[int], int]:
    """Byte offset of each run in a staging buffer (64-byte aligned) and the buffer's total size."""
    offsets, cursor = [], 0
    for nbytes in nbytes_per_run:
        offsets.append(cursor)
        cursor += -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
    return offsets, cursor


def run_shape(fp: ModelFingerprint, num_blocks: int) -> tuple[int, ...]:
    return (fp.num_layers, 2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)


def layer_piece_shape(fp: ModelFingerprint, num_blocks: int) -> tuple[int, ...]:
    """One layer of num_blocks blocks, as a layer-streamed transfer moves it: [2, n, block_size, H, D]."""
    return (2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)


def as_blocks(flat_u8: torch.Tensor, fp: ModelFingerprint, num_blocks: int) -> torch.Tensor:
    """A flat uint8 run view reinterpreted as [L, 2, num_blocks, block_size, H, D] of the pool dtype."""
    return flat_u8.view(TORCH_DTYPES[fp.dtype]).view(run_shape(fp, num_blocks))


def block_planes(blocks: torch.Tensor) -> list[torch.Tensor]:
    """The 2 * num_layers planes of blocks [L, 2, n, bs, H, D], in staging order (layer-major, K then V),
    each a flat uint8 view of blocks[l, kv] sharing its memory. Each plane must be contiguous: true for a
    run of a contiguous pool (kv[:, :, s:s+n]) and for a staging piece; ValueError otherwise."""
    planes = []
    for layer in range(blocks.shape[0]):
        for kind in range(2):
            plane = blocks[layer, kind]  # [n, bs, H, D]
            if not plane.is_contiguous():
                raise ValueError("a KV plane must be contiguous to travel without a copy")
            planes.append(plane.view(-1).view(torch.uint8))
    return planes




def split_pieces(flat_u8: np.ndarray, count: int) -> HostPieces:
    """A flat host byte piece (numpy uint8: a run's staging piece) as `count` equal pieces (its planes, or itself)."""
    planes, whole = flat_u8.reshape(count, -1), memoryview(flat_u8)
    size = planes.shape[1]
    return planes, [whole[i * size : (i + 1) * size] for i in range(count)]


def gather_run(kv: torch.Tensor, run: BlockRun, out_flat_u8: torch.Tensor, fp: ModelFingerprint) -> None:
    """Copies kv[:, :, run] (strided) into the contiguous staging view out_flat_u8."""
    out = as_blocks(out_flat_u8, fp, run.num_blocks)  # [L, 2, n, bs, H, D]
    copy_tensor(out, kv[:, :, run.start : run.start + run.num_blocks])


def scatter_run(kv: torch.Tensor, flat_u8: torch.Tensor, fp: ModelFingerprint, dst_block_ids: Sequence[int]) -> None:
    """Writes one received run into the receiver's blocks dst_block_ids (any ids, in run order)."""
    src = as_blocks(flat_u8, fp, len(dst_block_ids))  # [L, 2, n, bs, H, D]
    position = 0
    for dst in group_runs(dst_block_ids):
        end = position + dst.num_blocks
        copy_tensor(kv[:, :, dst.start : dst.start + dst.num_blocks], src[:, :, position:end])
        position = end
