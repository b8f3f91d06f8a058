"""Building blocks of the Llama-family decoder: RMSNorm, rotary embedding, gated MLP.

`fused=True` (the step's attention backend runs the layers' Triton kernels: CUDA, or CPU tensors under Triton's
interpreter) takes one launch per norm, per residual add + norm and per SiLU x up (engine/model/fused_triton.py);
otherwise the CPU float32 passes of fused_cpu.py, or torch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import RopeScaling
from engine.model import fused_cpu
from engine.model.linear import meta_linear


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like Hugging Face's LlamaRMSNorm (on CPU float32 in one
    fused pass: engine/model/fused_cpu.py)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta", dtype=dtype))

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        # x: [..., dim]
        if fused and x.dim() == 2:
            return triton_kernels().rms_norm(x, self.weight, self.eps)
        if x.dim() == 2 and fused_cpu.supports(x):
            return fused_cpu.rms_norm(x, self.weight, self.eps)
        return fused_cpu.rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, delta: torch.Tensor, residual: torch.Tensor,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); delta, residual: [T, dim]. Fused (one Triton launch), or
        on CPU float32 (one fused pass), the sum is written into residual; elsewhere residual is left as it was."""
        if fused and residual.is_contiguous():
            return triton_kernels().add_rms_norm_(residual, delta, self.weight, self.eps), residual
        if fused_cpu.supports(delta) and fused_cpu.supports(residual) and residual.is_contiguous():
            return fused_cpu.add_rms_norm_(residual, delta, self.weight, self.eps), residual
        return fused_cpu.add_rms_norm_reference(residual, delta, self.weight, self.eps)


def triton_kernels():
    """engine/model/fused_triton.py, imported on first use: it imports triton, which only the Triton path needs."""
    from engine.model import fused_triton  # noqa: PLC0415
    return fused_triton


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim // 2], with linear or Llama-3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Low frequencies are divided by `factor`, high ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, each [T, 1, head_dim]; computed once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim]. On CPU float32 x is rotated in place (fused, the same
    roundings as the reference) and returned; elsewhere a new tensor."""
    if fused_cpu.supports(x) and x.stride(1) == x.shape[2]:
        return fused_cpu.rotate_(x, cos, sin)
    return fused_cpu.rotate_reference(x, cos, sin)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul. Tensor-parallel: intermediate_size is
    this rank's share, gate-up column-parallel, down_proj the row-parallel layer `down_proj` (it all-reduces)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 down_proj: nn.Module | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = meta_linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = down_proj or meta_linear(intermediate_size, hidden_size, False, dtype)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if fused:
            return self.down_proj(triton_kernels().silu_mul(gate_up, self.intermediate_size))
        hidden = F.silu(gate_up[:, :self.intermediate_size])  # [T, intermediate]
        return self.down_proj(hidden.mul_(gate_up[:, self.intermediate_size:]))
