"""Loading a local Hugging Face checkpoint directory: dtype/device choice and safetensors weights."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model.causal_lm import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is a ValueError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on CPU (exact and fastest there); the checkpoint's dtype on GPU."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(model_config.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: model.safetensors, or the shards an index names."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard files: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        return shards
    raise ValueError(f"model directory {model_dir} has no model.safetensors "
                     "(nor model.safetensors.index.json with shards)")


def iter_checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, lazily, one file open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_model_dir(model: str | Path) -> Path:
    model_dir = Path(model)
    if model_dir.is_file():
        raise ValueError(f"model path {str(model)!r} is a file but not a GGUF file (it does not start with b'GGUF'); "
                         "a model is a GGUF file or a Hugging Face checkpoint directory")
    if not model_dir.is_dir():
        raise ValueError(f"model path {str(model)!r} does not exist or is not a directory")
    return model_dir


def load_model(model_dir: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> CausalLM:
    """Build the model on device and fill it from the checkpoint (ValueError on any mismatch)."""
    return filled_model(iter_checkpoint_tensors(model_dir), model_config, dtype, device, max_positions)


def filled_model(weights: Iterable[tuple[str, torch.Tensor]], model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> CausalLM:
    """The model allocated on device without initial values (nothing drawn that loading would overwrite), filled
    from Hugging Face-named tensors (ValueError on a missing, extra or misshapen one), its kernels prepared."""
    model = CausalLM(model_config, dtype, max_positions).materialize(device)
    model.load_weights(weights)
    model.prepare_kernels()
    return model.eval()
