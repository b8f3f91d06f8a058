"""The KV pool's memory plan: the arithmetic over a measured report, its overrides, and the profiling
forward (run here on CPU, where nothing is measured)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.attention.backends import TorchBackend
from engine.config import EngineConfig, ModelConfig
from engine.kv.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES, KVCacheSpec
from engine.model.loader import load_model
from engine.runner.memory_plan import (DeviceMemoryReport, dummy_prompt_lengths, model_weight_bytes, plan_kv_cache,
                                       plan_memory, profile_peak_activation_bytes)
from tests.support.engines import make_llm

GIB = 1 << 30
# Llama-3-8B's KV in bfloat16: 32 layers x 2 x 16 tokens x 8 KV heads x 128 x 2 bytes = 2 MiB per block.
LLAMA8B_SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
LLAMA8B_WEIGHTS = 16_060_522_496  # 8.03e9 bfloat16 parameters


def h100_report(total: int = 80 * GIB, activations: int = 2 * GIB) -> DeviceMemoryReport:
    return DeviceMemoryReport(total_bytes=total, other_bytes=600 << 20, weights_bytes=LLAMA8B_WEIGHTS,
                              activation_bytes=activations, graph_pool_bytes=512 << 20, profiled_tokens=8192)


def test_measured_plan_arithmetic():
    assert LLAMA8B_SPEC.bytes_per_block == 2 << 20
    plan = plan_kv_cache(h100_report(), EngineConfig(gpu_memory_utilization=0.85), LLAMA8B_SPEC)
    # 0.85 x 80 GiB = 73014444032; minus the weights, 2 GiB and 512 MiB = 54269566976 bytes (the 600 MiB of
    # other use fit in the 12 GiB of headroom the utilization leaves)
    assert plan.source == "measured"
    assert plan.kv_budget_bytes == 54_269_566_976
    assert plan.num_blocks == 25_877
    assert plan.bytes_per_block == 2 << 20
    assert plan.report == h100_report()
    line = plan.describe()
    assert "25877 blocks x 2.00 MiB = 50.54 GiB" in line
    assert "0.85 x 80.00 GiB = 68.00 GiB usable" in line and "weights 14.96 GiB" in line
    assert "activations at 8192 tokens 2.00 GiB" in line and "CUDA graphs 0.50 GiB" in line


def test_gpu_memory_utilization_moves_the_budget_by_its_share_of_the_device():
    blocks = {u: plan_kv_cache(h100_report(), EngineConfig(gpu_memory_utilization=u), LLAMA8B_SPEC).num_blocks
              for u in (0.5, 0.85, 0.9)}
    assert blocks == {0.5: 11_541, 0.85: 25_877, 0.9: 27_925}
    assert blocks[0.9] - blocks[0.85] == int(0.05 * 80 * GIB) // (2 << 20)  # 4 GiB = 2048 blocks


def test_model_that_does_not_fit_names_every_number():
    report = h100_report(total=24 * GIB, activations=4 * GIB + GIB // 2)
    with pytest.raises(ValueError) as err:
        plan_kv_cache(report, EngineConfig(max_num_seqs=256), LLAMA8B_SPEC)
    message = str(err.value)
    for part in ("model does not fit", "0.85 x 24.00 GiB = 20.40 GiB usable", "other 0.59 GiB",
                 "weights 14.96 GiB", "activations at 8192 tokens 4.50 GiB", "CUDA graphs 0.50 GiB",
                 "leave 0.44 GiB", "256 blocks (max_num_seqs) x 2.00 MiB = 0.50 GiB"):
        assert part in message, (part, message)
    # The same device holds the minimum of 128 sequences: the pool gets all 0.44 GiB.
    plan = plan_kv_cache(report, EngineConfig(max_num_seqs=128), LLAMA8B_SPEC)
    assert plan.num_blocks == plan.kv_budget_bytes // (2 << 20) == 226


def test_other_use_takes_only_what_exceeds_the_headroom():
    """gpu_memory_utilization is this engine's share: other processes cost it nothing while they fit in the
    rest of the device, and then exactly what they take beyond it."""
    config = EngineConfig(gpu_memory_utilization=0.85)
    alone = plan_kv_cache(h100_report(), config, LLAMA8B_SPEC)
    crowded = dataclasses.replace(h100_report(), other_bytes=20 * GIB)  # 8 GiB past the 12 GiB of headroom
    assert alone.num_blocks - plan_kv_cache(crowded, config, LLAMA8B_SPEC).num_blocks == 8 * GIB // (2 << 20)
    # Two engines sharing one GPU at 0.45 each: the second sees the first's 0.45 (and a context) as other use
    # and still gets its own 0.45, so together they stay within 0.9 of the device.
    half = EngineConfig(gpu_memory_utilization=0.45)
    first = plan_kv_cache(h100_report(), half, LLAMA8B_SPEC)
    neighbour = dataclasses.replace(h100_report(), other_bytes=int(0.45 * 80 * GIB) + (600 << 20))
    assert plan_kv_cache(neighbour, half, LLAMA8B_SPEC).num_blocks == first.num_blocks


def test_weights_larger_than_the_device_do_not_fit():
    with pytest.raises(ValueError, match=r"leave -\d+\.\d\d GiB"):
        plan_kv_cache(h100_report(total=16 * GIB), EngineConfig(), LLAMA8B_SPEC)


def test_explicit_sizes_override_the_measured_plan():
    report = h100_report(total=16 * GIB)  # would not fit if measured
    blocks = plan_kv_cache(report, EngineConfig(num_kv_blocks=7, kv_cache_memory=GIB), LLAMA8B_SPEC)
    assert (blocks.source, blocks.num_blocks, blocks.kv_budget_bytes) == ("num_kv_blocks", 7, 7 * (2 << 20))
    memory = plan_kv_cache(report, EngineConfig(kv_cache_memory=GIB + 1), LLAMA8B_SPEC)
    assert (memory.source, memory.num_blocks, memory.kv_budget_bytes) == ("kv_cache_memory", 512, GIB + 1)
    assert memory.describe() == "KV cache 512 blocks x 2.00 MiB = 1.00 GiB (kv_cache_memory)"
    assert blocks.report is None and memory.report is None  # nothing measured is used
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(report, EngineConfig(kv_cache_memory=1 << 20), LLAMA8B_SPEC)


def test_cpu_keeps_the_default_pool_and_logs_the_plan(tiny_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="tandem.engine")
    model, model_config = _tiny_model(tiny_checkpoint("llama"))
    spec = _spec(model_config, block_size=16)
    plan = plan_memory(model, spec, EngineConfig(), torch.device("cpu"), TorchBackend())
    assert (plan.source, plan.report) == ("cpu default", None)
    assert plan.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // spec.bytes_per_block
    assert any("memory plan: KV cache" in r.getMessage() and "cpu default" in r.getMessage()
               for r in caplog.records)
    engine = make_llm(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20).engine
    assert engine.memory_plan.source == "kv_cache_memory"
    assert engine.num_total_blocks == engine.memory_plan.num_blocks == (8 << 20) // spec.bytes_per_block


@pytest.mark.parametrize("max_model_len", [None, 24])
def test_profiling_forward_runs_the_largest_step_and_returns_its_blocks(tiny_checkpoint, max_model_len):
    model, model_config = _tiny_model(tiny_checkpoint("llama"))
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=max_model_len)
    spec = _spec(model_config, block_size=config.block_size)
    profile = profile_peak_activation_bytes(model, spec, config, torch.device("cpu"))
    lengths = [57] + [1] * 7 if max_model_len is None else [24, 24, 11] + [1] * 5
    assert (profile.num_tokens, profile.num_seqs) == (64, 8)
    assert profile.num_blocks == sum(-(-n // 16) for n in lengths)
    assert profile.free_blocks_after == profile.num_blocks  # every block went back
    assert profile.peak_bytes is None  # CPU: the forward ran, nothing was measured


def test_dummy_prompt_lengths():
    assert dummy_prompt_lengths(2048, 131072, 256) == [1793] + [1] * 255
    assert dummy_prompt_lengths(64, 24, 8) == [24, 24, 11] + [1] * 5
    assert dummy_prompt_lengths(100, 10, 3) == [10, 10, 10]  # a step never holds more
    assert dummy_prompt_lengths(4, 1024, 256) == [1, 1, 1, 1]


def test_weight_bytes_count_tied_embeddings_once(tiny_checkpoint):
    model, model_config = _tiny_model(tiny_checkpoint("qwen2"))
    assert model_config.tie_word_embeddings
    every = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    embedding = model.embed_tokens.weight
    assert model_weight_bytes(model) == every - embedding.numel() * embedding.element_size()


def _tiny_model(path):
    model_config = ModelConfig.from_dir(path)
    model = load_model(path, model_config, torch.float32, torch.device("cpu"),
                       model_config.max_position_embeddings)
    return model, model_config


def _spec(model_config: ModelConfig, block_size: int) -> KVCacheSpec:
    return KVCacheSpec(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                       block_size, torch.float32)
