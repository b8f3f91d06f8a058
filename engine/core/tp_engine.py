"""build_tp_engine: an LLMEngine over a tensor-parallel group (EngineConfig.tensor_parallel_size > 1). Everything
that can be checked without starting a process is checked first (the shapes split, enough GPUs); a failure after
the followers started kills them before it is raised, so a bad start leaves no process behind."""
from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import LLMEngine
from engine.model.tp_weights import load_shard
from engine.parallel.layout import check_tp_shapes
from engine.parallel.rank_service import RankServiceFactory
from engine.runner.tp_leader import FollowerLauncher, TPLeader
from engine.text.tokenizer import Tokenizer


def check_tp_start(model_config: ModelConfig, config: EngineConfig, device: torch.device,
                   own_devices: bool = False) -> None:
    """ValueError when this group cannot start: shapes that do not split, more ranks than GPUs (unless the
    followers' launcher gives each its own device: own_devices)."""
    size = config.tensor_parallel_size
    check_tp_shapes(model_config, size)
    first = device.index or 0  # rank r runs on GPU first + r
    if device.type == "cuda" and not own_devices and torch.cuda.device_count() < first + size:
        raise ValueError(f"tensor_parallel_size {size} from {device} needs GPUs {first}..{first + size - 1} (one per "
                         f"rank); this node has {torch.cuda.device_count()}")


def build_tp_engine(model: str, model_config: ModelConfig, tokenizer: Tokenizer, config: EngineConfig,
                    dtype: torch.dtype, device: torch.device, max_positions: int,
                    launcher: FollowerLauncher | None = None,
                    rank_service: RankServiceFactory | None = None) -> LLMEngine:
    """model: resolved ("tiny", a GGUF file, a checkpoint directory). This process is rank 0: it loads its own
    shard while the followers load theirs, then builds the engine (which agrees on the KV pool with them).
    launcher: how the followers start (None: child processes of this one; tp_leader.py). rank_service: what each
    follower runs beside its steps (engine/parallel/rank_service.py)."""
    check_tp_start(model_config, config, device, own_devices=launcher is not None and launcher.own_resources)
    leader = TPLeader.start(model, model_config, config, dtype, device, max_positions, launcher, rank_service)
    try:
        net = load_shard(model, model_config, leader.shard, dtype, device, max_positions)
        leader.wait_ready()
        return LLMEngine(net, tokenizer, model_config, config, dtype, device, tp_leader=leader)
    except BaseException:
        leader.abort()
        raise
