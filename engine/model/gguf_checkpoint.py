"""GGUF checkpoints (llama.cpp's one-file format): the model's shape from the file's metadata, as the Hugging Face
config.json it stands for, and its tensors dequantized one at a time and renamed to Hugging Face's names, so the
engine loads a GGUF file through the same CausalLM.load_weights as a safetensors checkpoint. The tokenizer's
vocabulary and chat template are in the same metadata (`GGUFCheckpoint.metadata`); engine/text/gguf_tokenizer.py
builds the tokenizer from it. The file is read by engine/model/gguf_file.py and dequantized by
engine/model/gguf_dequant.py: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants (Q2_K .. Q6_K)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.model.gguf_dequant import dequantize
from engine.model.gguf_file import MAGIC, GGUFFile, TensorInfo

# GGUF architecture -> (Hugging Face architecture, whether llama.cpp's converter permuted attn_q / attn_k rows)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
LAYER_TENSORS = {  # GGUF blk.N.<name> -> Hugging Face model.layers.N.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as file:
        return file.read(len(MAGIC)) == MAGIC


class GGUFCheckpoint:
    """One GGUF file, opened (memory-mapped) and checked: a supported architecture and tensor types. Its tensors are
    read only when `tensors()` is iterated."""

    def __init__(self, path: str | Path) -> None:
        """ValueError naming the file when it is not a readable GGUF file or holds what the engine cannot load."""
        from gguf import GGMLQuantizationType  # imported here: only GGUF checkpoints need the package
        self.path = Path(path)
        self._file = GGUFFile(self.path)
        self.metadata: dict[str, Any] = self._file.metadata
        self.gguf_architecture = str(self.metadata.get("general.architecture"))
        if self.gguf_architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.gguf_architecture!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        type_names = {_type_name(GGMLQuantizationType, t.type_id) for t in self._file.tensors}
        unsupported = sorted(type_names - set(SUPPORTED_TYPES))
        if unsupported:
            raise ValueError(f"{self.path}: tensor types {', '.join(unsupported)} are not supported; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
        self._tensors = {t.name: t for t in self._file.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(f"{self.path}: per-frequency rope factors (rope_freqs, Llama 3.1 and later) are not "
                             "supported yet")

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.gguf_architecture}.{key}", default)
        if value is None:
            raise ValueError(f"{self.path}: metadata {self.gguf_architecture}.{key} is missing")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The model's shape as a Hugging Face config.json (what ModelConfig.from_hf_dict reads, and what
        `tandem convert` writes)."""
        architecture, _ = ARCHITECTURES[self.gguf_architecture]
        num_heads = int(self._get("attention.head_count"))
        hidden = int(self._get("embedding_length"))
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab_size = self.metadata.get(f"{self.gguf_architecture}.vocab_size") or (len(tokens) if tokens else None)
        if vocab_size is None:
            vocab_size = self._tensors["token_embd.weight"].shape[1]
        config = {
            "architectures": [architecture],
            "model_type": self.gguf_architecture,
            "vocab_size": int(vocab_size),
            "hidden_size": hidden,
            "intermediate_size": int(self._get("feed_forward_length")),
            "num_hidden_layers": int(self._get("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._get("attention.head_count_kv", num_heads)),
            "head_dim": int(self._get("attention.key_length", hidden // num_heads)),
            "max_position_embeddings": int(self._get("context_length", 2048)),
            "rms_norm_eps": float(self._get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "torch_dtype": self._natural_dtype(),
        }
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if self.metadata.get(name) is not None:
                config[key] = int(self.metadata[name])
        return config

    def _natural_dtype(self) -> str:
        """The dtype the weights would be used in on a GPU: that of unquantized files, else bfloat16."""
        from gguf import GGMLQuantizationType
        kinds = {_type_name(GGMLQuantizationType, t.type_id) for t in self._file.tensors if len(t.shape) > 1}
        return {frozenset({"F32"}): "float32", frozenset({"F16"}): "float16"}.get(frozenset(kinds), "bfloat16")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as (Hugging Face name, float32 tensor in Hugging Face's layout), dequantized one at a time;
        attn_q / attn_k rows un-permuted where llama.cpp's converter permuted them."""
        config = self.hf_config()
        _, permuted = ARCHITECTURES[self.gguf_architecture]
        for info in self._file.tensors:
            name = hf_tensor_name(info.name)
            if name is None:
                raise ValueError(f"{self.path}: tensor {info.name!r} has no place in the model")
            weight = self._dequantized(info)
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
            yield name, weight

    def _dequantized(self, info: TensorInfo) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        type_name = _type_name(GGMLQuantizationType, info.type_id)
        return dequantize(self._file.raw(info), type_name).reshape(info.torch_shape)  # float32


def hf_tensor_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; token_embd.weight -> model.embed_tokens.weight;
    None for a name the engine has no place for."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in MODEL_TENSORS:
        return f"{MODEL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def _type_name(types, type_id: int) -> str:
    try:
        return types(type_id).name
    except ValueError:
        return f"type {type_id}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute of a q/k projection (its rotary pairs interleaved, Hugging Face's in two halves):
    weight [num_heads * head_dim, ...] with, per head, rows (0, d/2, 1, d/2 + 1, ...) -> (0, 1, ..., d - 1)."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])  # [heads, d/2, 2, ...]
    return rows.transpose(1, 2).reshape(weight.shape)
