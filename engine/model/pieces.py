"""A forward cut at its attention calls: the pieces between them, for piecewise CUDA graphs of mixed steps.

Per layer, CausalLM.forward runs a norm, the QKV projection, the rotation (and, fused, the K/V store), the
attention, o_proj, an add + norm and the MLP. All of it but the attention depends only on how many tokens the
step holds; the attention depends on its sequences (their lengths and block tables). ForwardPieces cuts the
forward into num_layers + 1 pieces around the num_layers attention calls, so that each piece can be captured
once per token count and replayed, with the attention run eager between them (vLLM's piecewise graphs):

    piece 0         embed, the rotary tables, layer 0 up to its attention's q, k, v
    piece l         layer l-1 from its o_proj (reading the attention's output) to layer l's q, k, v
    piece L         layer L-1 from its o_proj, the final norm

A piece reads and writes only PieceBuffers: static tensors sized for the most tokens, of which a piece of n
tokens uses the first n rows, so a graph captured of it replays on whatever a step writes there. What passes
from piece to piece (the residual stream, q/k/v, the attention's output) lives there; everything else a piece
computes is its own scratch. The pieces compute exactly what CausalLM.forward computes, op for op: tested
against it in tests/engine/test_mixed_graphs.py. One rank only (no tensor parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.layers import triton_kernels


@dataclass(frozen=True)
class PieceBuffers:
    """The static tensors the pieces read and write (max_tokens rows each)."""

    input_ids: torch.Tensor  # [M] int64
    positions: torch.Tensor  # [M] int64
    slots: torch.Tensor      # [M] int64 pool slot of each token's K/V (-1: written nowhere, a padding row)
    cos: torch.Tensor        # [M, 1, head_dim] rotary tables of the positions
    sin: torch.Tensor        # [M, 1, head_dim]
    residual: torch.Tensor   # [M, hidden] the residual stream
    qkv: torch.Tensor        # [M, (H + 2 * H_kv) * D] a layer's q, k (rotated) and v
    attn: torch.Tensor       # [M, H, D] a layer's attention output
    hidden: torch.Tensor     # [M, hidden] the forward's output

    @classmethod
    def allocate(cls, model: CausalLM, max_tokens: int, device: torch.device) -> "PieceBuffers":
        cfg, dtype = model.config, model.norm.weight.dtype
        attn = model.layers[0].self_attn
        ints = [torch.zeros(max_tokens, dtype=torch.int64, device=device) for _ in range(3)]
        ints[2].fill_(-1)

        def rows(*shape: int) -> torch.Tensor:
            return torch.zeros(max_tokens, *shape, dtype=dtype, device=device)

        return cls(*ints, rows(1, cfg.head_dim), rows(1, cfg.head_dim), rows(cfg.hidden_size),
                   rows(attn.q_size + 2 * attn.kv_size), rows(attn.num_heads, cfg.head_dim), rows(cfg.hidden_size))

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]


class ForwardPieces:
    """The pieces of one model over one KV pool. fused: the step's backend runs the layers' Triton kernels (the
    K/V store then happens inside the piece, else inside the eager attention)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, fused: bool, buffers: PieceBuffers) -> None:
        if model.shard is not None:
            raise ValueError("piecewise forwards are for one rank (tensor_parallel_size 1)")
        self.model, self.kv_cache, self.fused, self.buffers = model, kv_cache, fused, buffers

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, n: int) -> None:
        """Write a step's T tokens into the buffers' first rows and pad them to n rows: token 0 at position 0,
        its K/V written nowhere (slot -1). Changes only the buffers' input rows [0, n)."""
        b, tokens = self.buffers, input_ids.shape[0]
        b.input_ids[:tokens].copy_(input_ids)
        b.positions[:tokens].copy_(positions)
        b.slots[:tokens].copy_(slots)
        if n > tokens:
            b.input_ids[tokens:n].zero_()
            b.positions[tokens:n].zero_()
            b.slots[tokens:n].fill_(-1)

    def run_piece(self, index: int, n: int) -> None:
        """Piece `index` over the first n rows of the buffers (see the module's docstring). Writes the pool's
        slots of those rows' K/V when fused (piece index < num_layers), and the buffers."""
        b, model, layers = self.buffers, self.model, self.model.layers
        residual = b.residual[:n]  # [n, hidden]
        if index == 0:
            residual.copy_(model.embed_tokens(b.input_ids[:n]))
            torch.index_select(model.rotary.cos, 0, b.positions[:n], out=b.cos[:n, 0])
            torch.index_select(model.rotary.sin, 0, b.positions[:n], out=b.sin[:n, 0])
            self._project(0, layers[0].input_layernorm(residual, self.fused), n)
            return
        done = layers[index - 1]
        delta = done.self_attn.o_proj(b.attn[:n].reshape(n, -1))  # [n, hidden]
        x, summed = done.post_attention_layernorm.add_and_norm(delta, residual, self.fused)
        delta = done.mlp(_kept(x, summed, residual), self.fused)
        norm = model.norm if index == len(layers) else layers[index].input_layernorm
        x, summed = norm.add_and_norm(delta, residual, self.fused)
        x = _kept(x, summed, residual)
        if index == len(layers):
            b.hidden[:n].copy_(x)
        else:
            self._project(index, x, n)

    def _project(self, layer: int, x: torch.Tensor, n: int) -> None:
        """Layer `layer`'s q, k (normed, rotated) and v of x [n, hidden] into buffers.qkv (and, fused, K/V into
        the pool at buffers.slots)."""
        attn, b = self.model.layers[layer].self_attn, self.buffers
        qkv = b.qkv[:n]  # [n, (H + 2 * H_kv) * D]
        qkv.copy_(attn.qkv_proj(x))
        v = qkv[:, attn.q_size + attn.kv_size:].view(n, attn.num_kv_heads, attn.head_dim)
        rope = (b.cos[:n], b.sin[:n])
        if self.fused:
            q, k = attn.normed_qk(qkv)
            k_pool, v_pool = self.kv_cache.layer_slots(layer)
            triton_kernels().rotary_store_(q, k, v, *rope, k_pool, v_pool, b.slots[:n])
        else:
            q, k = attn.normed_qk(qkv, rope)
        qk = qkv[:, :attn.q_size + attn.kv_size].view(n, attn.num_heads + attn.num_kv_heads, attn.head_dim)
        if q.data_ptr() != qk.data_ptr() or k.data_ptr() != qk[:, attn.num_heads:].data_ptr():
            qk[:, :attn.num_heads].copy_(q)  # the norm or the rotation made new tensors: back into the buffer
            qk[:, attn.num_heads:].copy_(k)

    def attend(self, layer: int, meta: AttentionMetadata) -> None:
        """Layer `layer`'s attention of the step's T = len(meta.slot_mapping) tokens, eager: reads buffers.qkv
        (unfused: stores its K/V into the pool first), writes buffers.attn's first T rows."""
        attn, b = self.model.layers[layer].self_attn, self.buffers
        tokens = meta.slot_mapping.shape[0]
        qkv = b.qkv[:tokens]
        q = qkv[:, :attn.q_size].view(tokens, attn.num_heads, attn.head_dim)  # [T, H, D]
        k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(tokens, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, attn.q_size + attn.kv_size:].view(tokens, attn.num_kv_heads, attn.head_dim)
        k_pool, v_pool = self.kv_cache.layer_slots(layer)
        if not self.fused:
            meta.backend.store(k, v, k_pool, v_pool, meta.slot_mapping)
        meta.backend.attend(q, k, v, k_pool, v_pool, meta, out=b.attn[:tokens])


def _kept(x: torch.Tensor, summed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """add_and_norm's sum into the residual buffer when it made a new tensor (the fused kernels write it in
    place); returns the normed x."""
    if summed.data_ptr() != residual.data_ptr():
        residual.copy_(summed)
    return x
