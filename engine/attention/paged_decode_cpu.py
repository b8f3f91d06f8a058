"""Paged decode attention for CPU float32, compiled with numba.

Each single-token query reads its sequence's K/V straight from the pool through its block table: no
gathered copy of the context, no padding to the longest sequence. One parallel task per
(sequence, KV head) serves that head's whole group of query heads, so grouped-query attention reads
K/V once. On the benchmark mix (48 sequences, contexts up to ~500 tokens) one layer takes ~1 ms here
against ~8 ms for gather + padded SDPA.

AVAILABLE is False when numba is missing; attention then uses the torch path.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import numba
    from numba import njit, prange
    AVAILABLE = True
except ImportError:  # the torch gather + SDPA path serves instead
    AVAILABLE = False


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return AVAILABLE and device.type == "cpu" and dtype == torch.float32


def compile_kernel() -> None:
    """Compile (or load from numba's on-disk cache) the kernel now, at engine start, rather than
    inside the first decode step. torch's thread count is what it was: the first parallel launch in a
    process starts numba's OpenMP layer, which sets OpenMP's (so torch's) thread count to every core unless
    OMP_NUM_THREADS is set (Ray sets it in its workers), and an engine capped at part of the cores
    (torch.set_num_threads before it starts: `tandem plan`'s profile, `tandem serve --cpu-threads`) would
    run on all of them."""
    threads = torch.get_num_threads()
    q = torch.zeros(1, 1, 1, 4)
    pool = torch.zeros(4, 1, 4)
    paged_decode_attention(q.view(1, 1, 4), pool, pool, torch.zeros(1, 1, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), block_size=4)
    torch.set_num_threads(threads)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """q: [B, H, D]; k_pool, v_pool: [num_slots, H_kv, D]; block_tables: [B, max_blocks] int32;
    context_lens: [B] int32 (tokens each query attends to, itself included). Returns [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, H_kv, G, D]
    out = torch.empty_like(grouped)
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    _kernel(grouped.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), block_tables.numpy(),
            context_lens.numpy(), block_size, np.float32(head_dim ** -0.5), out.numpy())
    return out.view(batch, num_heads, head_dim)


if AVAILABLE:
    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def _kernel(q, k_pool, v_pool, tables, lens, block_size, scale, out):  # pragma: no cover (compiled)
        batch, num_kv_heads, group, head_dim = q.shape
        for task in prange(batch * num_kv_heads):
            b = task // num_kv_heads
            h = task - b * num_kv_heads
            length = lens[b]
            num_blocks = (length + block_size - 1) // block_size
            q_scaled = np.empty((group, head_dim), dtype=np.float32)
            for g in range(group):
                for d in range(head_dim):
                    q_scaled[g, d] = q[b, h, g, d] * scale
            # pass 1: scores [group, length], walking the block table block by block
            scores = np.empty((group, length), dtype=np.float32)
            for blk in range(num_blocks):
                base, first = tables[b, blk] * block_size, blk * block_size
                for off in range(min(block_size, length - first)):
                    k_row = k_pool[base + off, h]
                    for g in range(group):
                        acc = np.float32(0.0)
                        for d in range(head_dim):
                            acc += q_scaled[g, d] * k_row[d]
                        scores[g, first + off] = acc
            # softmax weights, left unnormalized; 1 / sum kept per query head
            inv_total = np.empty(group, dtype=np.float32)
            for g in range(group):
                top = scores[g, 0]
                for t in range(1, length):
                    top = max(top, scores[g, t])
                total = np.float32(0.0)
                for t in range(length):
                    weight = np.exp(scores[g, t] - top)
                    scores[g, t] = weight
                    total += weight
                inv_total[g] = np.float32(1.0) / total
            # pass 2: weighted sum of V rows into a local accumulator
            acc_out = np.zeros((group, head_dim), dtype=np.float32)
            for blk in range(num_blocks):
                base, first = tables[b, blk] * block_size, blk * block_size
                for off in range(min(block_size, length - first)):
                    v_row = v_pool[base + off, h]
                    for g in range(group):
                        weight = scores[g, first + off]
                        for d in range(head_dim):
                            acc_out[g, d] += weight * v_row[d]
            for g in range(group):
                for d in range(head_dim):
                    out[b, h, g, d] = acc_out[g, d] * inv_total[g]
