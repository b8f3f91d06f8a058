"""build_engine: a ready LLMEngine from a checkpoint directory, or the embedded default model."""
from __future__ import annotations

import logging
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import LLMEngine
from engine.model.default_model import UNTRAINED_NOTICE, build_default_model, default_model_config
from engine.model.loader import check_model_dir, load_model, resolve_device, resolve_dtype
from engine.text.tokenizer import ByteTokenizer, HFTokenizer

logger = logging.getLogger("tandem.engine")


def build_engine(model: str | Path | None, config: EngineConfig, dtype: str = "auto",
                 device: str = "auto") -> LLMEngine:
    """Load model weights and tokenizer and size the KV pool. ValueError names any bad argument,
    missing file or unsupported architecture."""
    torch_device = resolve_device(device)
    if model is None:
        model_config = default_model_config()
        torch_dtype = resolve_dtype(dtype, model_config, torch_device)
        max_positions = _max_positions(model_config, config)
        net = build_default_model(torch_dtype, torch_device, max_positions)
        tokenizer = ByteTokenizer()
        logger.warning(UNTRAINED_NOTICE)
    else:
        model_dir = check_model_dir(model)
        model_config = ModelConfig.from_dir(model_dir)
        torch_dtype = resolve_dtype(dtype, model_config, torch_device)
        tokenizer = HFTokenizer.from_dir(model_dir)
        net = load_model(model_dir, model_config, torch_dtype, torch_device,
                         _max_positions(model_config, config))
    return LLMEngine(net, tokenizer, model_config, config, torch_dtype, torch_device)


def _max_positions(model_config: ModelConfig, config: EngineConfig) -> int:
    if config.max_model_len is not None:
        return min(config.max_model_len, model_config.max_position_embeddings)
    return model_config.max_position_embeddings
