"""Seeded random checkpoints for benchmarks, saved with transformers (the format users load).

Shapes: "llama-25m" (hidden 512, 6 layers, GQA 8:2, vocab 8000: the CPU reference),
"qwen2.5-0.5b" (Qwen2.5-0.5B's shape, for GPUs) and "tiny-llama" (hidden 128, 2 layers, GQA 4:2, vocab 512:
`tandem selftest`'s correctness checks, built in a second). The tokenizer is a plain word-level vocabulary
("t0".."tN"): benchmarks feed token ids, the tokenizer only has to load.
"""
from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    "llama-25m": dict(arch="llama", vocab_size=8000, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=2048),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0),
    "tiny-llama": dict(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024),
}


def build_bench_checkpoint(out_dir: Path, shape: str, seed: int = 0) -> Path:
    """Write config, random weights (seeded) and a word-level tokenizer into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown checkpoint shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(seed)
    config = config_cls(**spec, initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    model = model_cls(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_word_level_tokenizer(out_dir, spec["vocab_size"])
    return out_dir


def write_word_level_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))
