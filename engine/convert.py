"""convert_gguf: a GGUF checkpoint written out as a Hugging Face checkpoint directory (config.json,
model.safetensors with the dequantized weights, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json), so transformers, vLLM or any other peer can load the very weights the engine serves
(`tandem convert model.gguf out_dir/`)."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from engine.model.gguf_checkpoint import GGUFCheckpoint
from engine.model.loader import DTYPES
from engine.text.gguf_tokenizer import tokenizer_from_gguf


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write `gguf_path` as a Hugging Face checkpoint into `out_dir` (created; files of the same names
    overwritten), weights in `dtype` (float32 keeps the dequantized values exactly). Returns out_dir.
    ValueError naming the file when it is not a GGUF checkpoint the engine can load, or for an unknown dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    checkpoint = GGUFCheckpoint(gguf_path)
    tokenizer = tokenizer_from_gguf(checkpoint.metadata, str(gguf_path))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**checkpoint.hf_config(), "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in checkpoint.tensors()}
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(out)
    return out


__all__ = ["convert_gguf"]
