"""The Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3) over a packed token batch.

forward() takes every scheduled token of every sequence as one flat batch [num_tokens] with its
positions, writes K/V into the paged pool and returns hidden states [num_tokens, hidden];
compute_logits() runs the LM head on just the rows that get sampled.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv.kv_cache import KVCache
from engine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, triton_kernels
from engine.model.linear import meta_linear, prepare_linears
from engine.model.tp_layers import ParallelLMHead, RowParallelLinear, TPShard, VocabParallelEmbedding

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, head_dim] each


class Attention(nn.Module):
    """Tensor-parallel (shard given): this rank's query and KV heads only (TPLayout), QKV column-parallel, o_proj
    row-parallel; the KV pool it writes holds the same KV heads."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: TPShard | None = None):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = local_heads(cfg, shard) + (cfg.head_dim,)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = meta_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = meta_linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype) if shard is None else \
            RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, shard)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * H_kv) * D]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_pool, v_pool = kv_cache.layer_slots(self.layer)
        if meta.backend.fused_layers:  # RoPE on q and k and the K/V store: one launch; then attention alone
            q, k = self.normed_qk(qkv)
            triton_kernels().rotary_store_(q, k, v, *rope, k_pool, v_pool, meta.slot_mapping)
            out = meta.backend.attend(q, k, v, k_pool, v_pool, meta)       # [T, H, D]
        else:
            q, k = self.normed_qk(qkv, rope)                               # [T, H, D], [T, H_kv, D]
            out = paged_attention(q, k, v, k_pool, v_pool, meta)           # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def normed_qk(self, qkv: torch.Tensor, rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, H_kv, D] out of qkv, per-head normed (Qwen3), rotated when rope is given."""
        num_tokens, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)  # [T, H + H_kv, D]
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before the rotation
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        if rope is not None:
            qk = apply_rotary(qk, *rope)  # q and k rotate together: one pass instead of two
        return qk[:, :self.num_heads], qk[:, self.num_heads:]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: TPShard | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        inter = cfg.intermediate_size if shard is None else shard.layout.intermediate_size
        down = None if shard is None else RowParallelLinear(inter, cfg.hidden_size, False, dtype, shard)
        self.mlp = GatedMLP(cfg.hidden_size, inter, dtype, down)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: RopeTables, meta: AttentionMetadata,
                kv_cache: KVCache, kv_written: Callable[[], None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the last layer's MLP output (the embeddings, residual None, for the first layer); residual: the
        sum of the embeddings and every earlier attention and MLP output. Returns (this layer's MLP output,
        the sum before it); the residual passed in may be written to (CPU: the add is fused into the norm).
        kv_written, when given, runs once the attention (which stores this layer's K/V) is issued, before the
        MLP: a layer-streamed transfer can send this layer's KV under the MLP's work."""
        fused = meta.backend.fused_layers
        if residual is None:
            residual, x = h, self.input_layernorm(h, fused)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual, fused)
        attention = self.self_attn(x, rope, meta, kv_cache)
        if kv_written is not None:
            kv_written()
        x, residual = self.post_attention_layernorm.add_and_norm(attention, residual, fused)
        return self.mlp(x, fused), residual


class CausalLM(nn.Module):
    """Parameters are created unallocated; call materialize(device) and load_weights() before use.

    shard (tensor parallelism): this rank's slice of the model (engine/model/tp_layers.py); load_weights then
    takes the rank's slices of the checkpoint tensors (engine/model/tp_weights.py), and compute_logits gives
    the whole logits on rank 0, None elsewhere. None: the whole model, no communication at all."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, shard: TPShard | None = None) -> None:
        super().__init__()
        self.config, self.shard = cfg, shard
        if shard is None:  # [vocab, hidden] unallocated, nothing drawn (the checkpoint fills it)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
                cfg.vocab_size, cfg.hidden_size, device="meta", dtype=dtype))
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.hidden_size, dtype, shard)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the LM head last: the parameters' order is their order in memory once materialized, which the CPU
        # matmuls' numerics follow (a migrated seeded request is compared token for token across processes)
        self.lm_head = meta_linear(cfg.hidden_size, cfg.vocab_size, False, dtype) if shard is None else \
            ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, shard)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def materialize(self, device: torch.device) -> "CausalLM":
        """Allocate (uninitialized) parameters on device; rotary tables are restored exactly."""
        rotary = self.rotary
        cos, sin = rotary.cos, rotary.sin
        # what to_empty() does, without its torch.empty_like on meta tensors: that imports sympy (0.6 s at start)
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # to_empty made them two tensors
        rotary.cos, rotary.sin = cos.to(device), sin.to(device)
        return self

    def prepare_kernels(self) -> None:
        """Once the weights are final: let each layer ready its device-specific kernels."""
        prepare_linears(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """on_layer(i), when given, runs once layer i has issued the work that stores its K/V (they are in
        the pool once that work completes), before its MLP: layer-wise KV streaming sends layer i then."""
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        rope = self.rotary.lookup(positions)
        for index, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, meta, kv_cache,
                                None if on_layer is None else lambda i=index: on_layer(i))
        return self.norm.add_and_norm(h, residual, meta.backend.fused_layers)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [S, hidden] rows to sample -> float32 logits [S, vocab] (tensor-parallel: on rank 0; every
        rank must call it, the others get None)."""
        if self.shard is None:
            return self.lm_head(hidden).float()
        return self.lm_head.gather(self.lm_head(hidden).float())

    def _rows(self, name: str, piece: str | None, ranges: dict) -> tuple[int, int] | None:
        """The rows of parameter `name` a checkpoint tensor fills: its fused piece's; a vocabulary shard's real
        rows (the last rank's padding rows are zeroed here); None: all."""
        if self.shard is not None and name in ("embed_tokens.weight", "lm_head.weight"):
            start, stop = self.shard.layout.vocab
            with torch.no_grad():
                self.get_parameter(name)[stop - start:].zero_()
            return 0, stop - start
        return None if piece is None else ranges[piece]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        ranges = _fused_ranges(self.config, self.shard)
        for hf_name, tensor in weights:
            target = _map_hf_name(hf_name, self.config)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            _copy_shard(params[name], tensor, self._rows(name, shard, ranges), hf_name)
            loaded.add(name if shard is None else f"{name}#{shard}")
        missing = [n for n in _expected_pieces(params, self.config) if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def _map_hf_name(hf_name: str, cfg: ModelConfig) -> tuple[str, str | None] | None:
    """HF tensor name -> (our parameter name, shard of a fused parameter or None); None = skip."""
    if "rotary_emb" in hf_name:
        return None
    if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


def local_heads(cfg: ModelConfig, shard: TPShard | None) -> tuple[int, int]:
    """(query heads, KV heads) this rank computes: all of them without tensor parallelism."""
    if shard is None:
        return cfg.num_heads, cfg.num_kv_heads
    return shard.layout.num_heads, shard.layout.num_kv_heads


def _fused_ranges(cfg: ModelConfig, shard: TPShard | None) -> dict[str, tuple[int, int]]:
    """Where each piece of a fused parameter (this rank's share of it) lies in the fused rows."""
    heads, kv_heads = local_heads(cfg, shard)
    q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
    inter = cfg.intermediate_size if shard is None else shard.layout.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, rows: tuple[int, int] | None, hf_name: str) -> None:
    target = param.data if rows is None else param.data.narrow(0, *_span(rows))
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _span(bounds: tuple[int, int]) -> tuple[int, int]:
    return bounds[0], bounds[1] - bounds[0]


def _expected_pieces(params: dict, cfg: ModelConfig) -> list[str]:
    pieces = []
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            pieces += [f"{name}#{s}" for s in ("q", "k", "v")]
        elif name.endswith("gate_up_proj.weight"):
            pieces += [f"{name}#{s}" for s in ("gate", "up")]
        else:
            pieces.append(name)
    return pieces
