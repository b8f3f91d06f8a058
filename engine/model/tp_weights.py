"""Each rank reads its own slices of the checkpoint: rank_cut names the rows or columns of one Hugging Face tensor
a rank holds (TPLayout), safetensors_slices reads just those bytes (safetensors' get_slice: no whole tensor is
materialized on any rank), sliced cuts tensors that were read whole (a GGUF file's, dequantized at load; the
embedded model's); load_shard builds one rank's model and fills it with them (rank 0 and every follower alike).

What a rank holds, in checkpoint terms (D = head_dim):
  q_proj weight/bias     rows q_heads * D              k_proj, v_proj weight/bias   rows kv_heads * D
  o_proj weight          columns q_heads * D           o_proj bias                  whole, rank 0 only
  gate_proj, up_proj     rows of the intermediate range down_proj                    its columns
  embed_tokens, lm_head  rows of the vocabulary range  norms (incl. Qwen3's q/k)    whole
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.causal_lm import CausalLM
from engine.model.default_model import TINY_MODEL, build_default_model
from engine.model.gguf_checkpoint import GGUFCheckpoint, is_gguf_file
from engine.model.loader import safetensors_files
from engine.model.tp_layers import TPShard
from engine.parallel.layout import TPLayout


@dataclass(frozen=True)
class Cut:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor; skip: the rank holds none of it."""

    dim: int = 0
    start: int = 0
    stop: int = 0
    skip: bool = False


SKIP = Cut(skip=True)


def rank_cut(hf_name: str, cfg: ModelConfig, layout: TPLayout) -> Cut | None:
    """The part of checkpoint tensor hf_name that this rank loads; None: the whole tensor."""
    leaf = hf_name.split(".")[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[-1]
    d = cfg.head_dim
    if module == "q_proj":
        return Cut(0, layout.q_heads[0] * d, layout.q_heads[1] * d)
    if module in ("k_proj", "v_proj"):
        return Cut(0, layout.kv_heads[0] * d, layout.kv_heads[1] * d)
    if module == "o_proj":
        if kind == "bias":
            return None if layout.rank == 0 else SKIP
        return Cut(1, layout.q_heads[0] * d, layout.q_heads[1] * d)
    if module in ("gate_proj", "up_proj"):
        return Cut(0, *layout.intermediate)
    if module == "down_proj":
        return Cut(1, *layout.intermediate)
    if module in ("embed_tokens", "lm_head"):
        return Cut(0, *layout.vocab)
    return None


def safetensors_slices(model_dir: Path, cfg: ModelConfig, layout: TPLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of every tensor of the checkpoint, each read as a slice of its file."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                cut = rank_cut(name, cfg, layout)
                if cut is None:
                    yield name, f.get_tensor(name)
                elif not cut.skip:
                    piece = f.get_slice(name)
                    yield name, piece[cut.start:cut.stop] if cut.dim == 0 else piece[:, cut.start:cut.stop]


def sliced(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig,
           layout: TPLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of tensors read whole (GGUF, the embedded model): narrowed views, no copies."""
    for name, tensor in weights:
        cut = rank_cut(name, cfg, layout)
        if cut is None:
            yield name, tensor
        elif not cut.skip:
            yield name, tensor.narrow(cut.dim, cut.start, cut.stop - cut.start)


def hf_tensors(model: torch.nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole (unsharded) CausalLM's parameters under their Hugging Face names, fused ones split back
    (the embedded model is drawn whole, then sliced per rank)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    pieces = {"qkv_proj": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
              "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))}
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        hf = name if name.startswith("lm_head") else f"model.{name}"
        module = hf.split(".")[-2]
        if module not in pieces:
            yield hf, param.detach()
            continue
        for part, start, stop in pieces[module]:
            yield hf.replace(module, part), param.detach()[start:stop]



def rank_weights(model: str, model_config: ModelConfig, shard: TPShard,
                 max_positions: int) -> Iterable[tuple[str, torch.Tensor]]:
    """This rank's slices of `model` (resolved: "tiny", a GGUF file or a checkpoint directory): read as slices
    from safetensors; a GGUF file's tensors are dequantized whole, one at a time, then cut; the embedded model is
    drawn whole (it is tiny), then cut."""
    if model == TINY_MODEL:
        whole = build_default_model(torch.float32, torch.device("cpu"), max_positions)
        return sliced(list(hf_tensors(whole, model_config)), model_config, shard.layout)
    if is_gguf_file(model):
        return sliced(GGUFCheckpoint(model).tensors(), model_config, shard.layout)
    return safetensors_slices(Path(model), model_config, shard.layout)


def load_shard(model: str, model_config: ModelConfig, shard: TPShard, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> CausalLM:
    """The rank's CausalLM on device, filled (ValueError on a missing or misshapen tensor), kernels prepared."""
    net = CausalLM(model_config, dtype, max_positions, shard).materialize(device)
    net.load_weights(rank_weights(model, model_config, shard, max_positions))
    net.prepare_kernels()
    return net.eval()
