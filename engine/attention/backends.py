"""The attention backends and how one is chosen for a device and dtype.

Every backend does the same three things per layer: store this step's K/V into the pool at the slot
mapping (one indexed copy), attend the single-token rows (decode), attend the prefill chunks. They differ
in how the two attention parts read the pool:

| backend      | decode rows                               | prefill chunks                      |
|--------------|-------------------------------------------|-------------------------------------|
| `triton`     | Triton paged kernel, flash-decoding split  | Triton varlen kernel over the pool  |
| `cpu_kernel` | numba paged kernel (CPU float32)           | torch SDPA per chunk                |
| `torch`      | gather + padded SDPA                       | torch SDPA per chunk                |

`auto` picks triton on CUDA, cpu_kernel on CPU float32, torch otherwise.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from engine.attention import paged_decode_cpu, torch_paths
from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """How a layer's attention reads and writes the paged pool; stateless apart from compiled kernels."""

    name: str
    supports_decode_graphs = False
    fused_layers = False  # the layers' own fused kernels (engine/model/fused_triton.py) run with this backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Store k/v into the pool at meta.slot_mapping (changes k_pool/v_pool there), then attend.

        q: [T, H, D]; k, v: [T, H_kv, D]; k_pool, v_pool: [num_slots, H_kv, D]. Returns [T, H, D]."""
        self.store(k, v, k_pool, v_pool, meta.slot_mapping)
        return self.attend(q, k, v, k_pool, v_pool, meta)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the pool, this step's K/V already in it (stored by forward, or by the layer's
        fused RoPE-and-store kernel). Writes and returns out [T, H, D] (a new tensor if None; a piecewise
        forward's static buffer otherwise), changes nothing else."""
        out = torch.empty_like(q) if out is None else out
        decodes = meta.num_decode_rows
        if decodes:
            self.decode_into(out[:decodes], q[:decodes], k_pool, v_pool, meta)
        if decodes < meta.num_seqs:
            self.prefill(out, q, k, v, k_pool, v_pool, meta)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """k_pool[slot_mapping] = k, v_pool[slot_mapping] = v: one indexed copy each."""
        k_pool.index_copy_(0, slot_mapping, k)
        v_pool.index_copy_(0, slot_mapping, v)

    def decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [B, H, D], the decode rows. Returns [B, H, D], a new tensor."""
        return self.decode_to(None, q, k_pool, v_pool, meta)

    def decode_into(self, out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    meta: AttentionMetadata) -> None:
        """decode(), written into out [B, H, D] (contiguous rows: a layer's output, or a graph's static buffer)."""
        self.decode_to(out, q, k_pool, v_pool, meta)

    @abstractmethod
    def decode_to(self, out: torch.Tensor | None, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows' attention, written into out when given (else into a new tensor), which it returns."""

    def prefill(self, out, q, k, v, k_pool, v_pool, meta: AttentionMetadata) -> None:
        """Writes out's rows of the prefill chunks (sequences [num_decode_rows, num_seqs))."""
        torch_paths.prefill_attention(out, q, k, v, k_pool, v_pool, meta)


class TorchBackend(AttentionBackend):
    name = "torch"

    def decode_to(self, out, q, k_pool, v_pool, meta):
        result = torch_paths.decode_attention(q, k_pool, v_pool, meta)
        return result if out is None else out.copy_(result)


class CpuKernelBackend(AttentionBackend):
    name = "cpu_kernel"

    def __init__(self) -> None:
        paged_decode_cpu.compile_kernel()

    def decode_to(self, out, q, k_pool, v_pool, meta):  # the kernel writes out's rows: no copy
        batch = meta.num_decode_rows
        return paged_decode_cpu.paged_decode_attention(q, k_pool, v_pool, meta.block_tables[:batch],
                                                       meta.seq_lens[:batch], meta.block_size, out=out)


UNIFIED_DECODE_MAX_CONTEXT = 1024  # a mixed step's decode rows this short go through the prefill kernel


class TritonBackend(AttentionBackend):
    """Triton kernels for all three parts; the only backend whose decode CUDA graphs can capture (no host
    sync, and its KV write skips the negative slots of a graph's padding rows)."""

    name = "triton"
    supports_decode_graphs = True
    fused_layers = True

    def __init__(self) -> None:
        from engine.attention import triton_decode, triton_prefill, triton_store  # imports triton
        self._decode, self._prefill, self._store = triton_decode, triton_prefill, triton_store
        self._step_plan: tuple | None = None  # (meta, DecodeScratch, tables, seq_lens) of the step being run

    def store(self, k, v, k_pool, v_pool, slot_mapping):
        self._store.store_kv(k, v, k_pool, v_pool, slot_mapping)

    def attend(self, q, k, v, k_pool, v_pool, meta, out=None):
        """AttentionBackend.attend; a mixed step whose decode rows' contexts are at most UNIFIED_DECODE_MAX_CONTEXT
        tokens runs them through the prefill kernel with its prompts (a decode row is a chunk of one token): one
        launch a layer instead of three (the decode kernel, its merge, the prefill kernel). Longer contexts keep the
        decode kernel, which splits them across the device."""
        decodes = meta.num_decode_rows
        if not 0 < decodes < meta.num_seqs or meta.decode_len_bound > UNIFIED_DECODE_MAX_CONTEXT:
            return super().attend(q, k, v, k_pool, v_pool, meta, out)
        out = torch.empty_like(q) if out is None else out
        self._prefill.paged_prefill(out, q, k_pool, v_pool, meta.block_tables, meta.query_start, meta.seq_lens, 0,
                                    meta.num_seqs, meta.max_prefill_query_len, meta.block_size)
        return out

    def decode_to(self, out, q, k_pool, v_pool, meta):
        """The decode rows' attention (the merge kernel writes out's rows: no copy). The step's plan (partition,
        partials, the rows' tables) is made by its first layer and reused by the others: a step's layers share one
        meta."""
        if self._step_plan is None or self._step_plan[0] is not meta:
            batch, (num_heads, head_dim), num_kv_heads = meta.num_decode_rows, q.shape[1:], k_pool.shape[1]
            scratch = self._decode.decode_scratch(batch, num_heads, num_kv_heads, head_dim, meta.decode_len_bound,
                                                  q.device)
            self._step_plan = (meta, scratch, meta.block_tables[:batch], meta.seq_lens[:batch])
        _, scratch, tables, seq_lens = self._step_plan
        return self._decode.paged_decode(q, k_pool, v_pool, tables, seq_lens, meta.block_size, meta.decode_len_bound,
                                         out=out, scratch=scratch)

    def prefill(self, out, q, k, v, k_pool, v_pool, meta):
        self._prefill.paged_prefill(out, q, k_pool, v_pool, meta.block_tables, meta.query_start, meta.seq_lens,
                                    meta.num_decode_rows, meta.num_seqs - meta.num_decode_rows,
                                    meta.max_prefill_query_len, meta.block_size)


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend for `requested` ("auto" | "torch" | "triton" | "cpu_kernel") on this device and dtype.
    ValueError says why a named backend cannot run here."""
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda" and triton_available():
            return TritonBackend()
        requested = "cpu_kernel" if paged_decode_cpu.supports(device, dtype) else "torch"
    if requested == "torch":
        return TorchBackend()
    if requested == "cpu_kernel":
        if not paged_decode_cpu.supports(device, dtype):
            raise ValueError(f"attention_backend 'cpu_kernel' needs numba and a CPU float32 engine; "
                             f"this one is {device.type} {dtype} (numba installed: {paged_decode_cpu.AVAILABLE})")
        return CpuKernelBackend()
    if requested == "triton":
        _check_triton_runs_on(device)
        return TritonBackend()
    raise ValueError(f"unknown attention_backend {requested!r}")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_triton_runs_on(device: torch.device) -> None:
    if not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' on CPU runs only under Triton's interpreter: "
                         "set TRITON_INTERPRET=1 before starting (it is for testing; it is slow)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention_backend 'triton' does not run on {device.type}")
