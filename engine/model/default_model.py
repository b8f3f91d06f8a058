"""The embedded default model: a small untrained Llama with seeded random weights and a byte tokenizer.

It exists so that `tandem demo`, the tests and the benchmarks run anywhere with no download. Its
weights are random, so its text is gibberish; LLM(model=None) says so when it loads it.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model.causal_lm import CausalLM

DEFAULT_MODEL_NAME = "tandem-default-untrained"
TINY_MODEL = "tiny"  # the name that asks for this model (model=None may mean a trained default)
DEFAULT_MODEL_SEED = 1234
UNTRAINED_NOTICE = ("Using the embedded default model (Llama architecture, seeded random weights, "
                    "byte-level tokenizer): it is UNTRAINED, so its text is gibberish.")

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
