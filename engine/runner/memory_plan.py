"""Memory plan: how many KV blocks the pool gets, from what the device holds and what a step needs.

On CUDA without an explicit size, the pool gets this engine's share of the device once everything else
the engine needs at its peak is counted, and never more than what is actually free:

    kv_budget = gpu_memory_utilization x total - weights - activations - graph pools
                - max(0, other - (1 - gpu_memory_utilization) x total)

- total: the device's memory (`torch.cuda.mem_get_info`);
- other: what is in use on the device besides our weights, measured after the profiling forward:
  other processes, the CUDA context, what the forward left behind (cuBLAS workspaces). It takes from
  the budget only what does not fit in the headroom the utilization leaves. So gpu_memory_utilization is
  this engine's share (vLLM's meaning): two engines on one GPU at 0.45 each get 0.45 of it each, in
  whichever order they start, and an engine alone on a device that others already fill gets no more
  than is free;
- weights: the bytes of the model's parameters (unique storages: tied embeddings count once);
- activations: the peak of a profiling forward of max_num_batched_tokens tokens that samples as many
  rows as a step can (max_num_seqs), through the engine's own ModelRunner, above what was in use;
- graph pools: the peak of a profiling forward of max_num_seqs single-token rows, what the largest
  captured decode graph holds in its private pool, plus, when prefill and mixed steps are captured too
  (engine/runner/mixed_graphs.py), the activations' peak again: their pieces' pool holds at most what the
  largest step's forward needs (0 when no graphs are captured: enforce_eager, a backend other than triton, CPU).

num_blocks = kv_budget // bytes_per_block, and it must be at least max_num_seqs (one block for every
sequence a step may run; max_model_len is then capped by the pool, as before), else ValueError with
every number. Explicit settings win and are not measured: num_kv_blocks, else kv_cache_memory bytes.
On CPU nothing is measured: kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend
from engine.config import EngineConfig
from engine.kv.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES, KVCache, KVCacheSpec, num_blocks_for_budget
from engine.model.causal_lm import CausalLM
from engine.runner.mixed_graphs import mixed_graphs_apply
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import ScheduledChunk, Sequence

logger = logging.getLogger("tandem.engine")
GIB = float(1 << 30)


@dataclass(frozen=True)
class DeviceMemoryReport:
    """What was measured on the device before sizing the KV pool, in bytes."""

    total_bytes: int
    other_bytes: int          # in use besides our weights: other processes, CUDA context, buffers
    weights_bytes: int
    activation_bytes: int     # peak of the profiling forward above what was in use before it
    graph_pool_bytes: int     # reserved for CUDA graphs
    profiled_tokens: int = 0  # tokens of the profiling forward


@dataclass(frozen=True)
class MemoryPlan:
    """The KV pool's size and where it came from. source: "measured", "num_kv_blocks",
    "kv_cache_memory" or "cpu default"; report is the measurement, set only when source is "measured"."""

    kv_budget_bytes: int
    num_blocks: int
    bytes_per_block: int
    source: str
    gpu_memory_utilization: float
    report: DeviceMemoryReport | None = None

    def describe(self) -> str:
        """One line for the log: the pool, and the terms of the formula when it was measured."""
        line = (f"KV cache {self.num_blocks} blocks x {self.bytes_per_block / (1 << 20):.2f} MiB = "
                f"{self.num_blocks * self.bytes_per_block / GIB:.2f} GiB ({self.source}")
        if self.report is None:
            return line + ")"
        return f"{line}: {_terms(self.report, self.gpu_memory_utilization)})"


@dataclass(frozen=True)
class ActivationProfile:
    """What the profiling forward ran and measured. peak_bytes is None where the device keeps no
    allocator statistics (CPU): the forward ran, nothing was measured. free_blocks_after equals
    num_blocks when the forward returned every block of its temporary cache."""

    num_tokens: int
    num_seqs: int
    num_blocks: int
    free_blocks_after: int
    peak_bytes: int | None


def plan_kv_cache(report: DeviceMemoryReport | None, config: EngineConfig, spec: KVCacheSpec) -> MemoryPlan:
    """Pure arithmetic. num_kv_blocks wins, then kv_cache_memory; else the formula of the module
    docstring over report, or, with no report (CPU), DEFAULT_CPU_KV_CACHE_BYTES. Guarantees at least
    one block, and at least max_num_seqs blocks for a measured plan; ValueError with the numbers if not."""
    per_block, util = spec.bytes_per_block, config.gpu_memory_utilization
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
        return MemoryPlan(n * per_block, n, per_block, "num_kv_blocks", util)
    if config.kv_cache_memory is not None or report is None:
        explicit = config.kv_cache_memory is not None
        budget = config.kv_cache_memory if explicit else DEFAULT_CPU_KV_CACHE_BYTES
        return MemoryPlan(budget, num_blocks_for_budget(spec, budget), per_block,
                          "kv_cache_memory" if explicit else "cpu default", util)
    crowding = max(0, report.other_bytes - int((1 - util) * report.total_bytes))  # others past our headroom
    budget = (int(util * report.total_bytes) - report.weights_bytes - report.activation_bytes
              - report.graph_pool_bytes - crowding)
    needed = config.max_num_seqs
    if budget < needed * per_block:
        raise ValueError(
            f"model does not fit: {_terms(report, util)}{_crowding(crowding)} leave {_gib(budget)} GiB for the KV "
            f"cache; "
            f"it needs at least {needed} blocks (max_num_seqs) x {per_block / (1 << 20):.2f} MiB = "
            f"{_gib(needed * per_block)} GiB. Raise gpu_memory_utilization, lower max_num_batched_tokens "
            f"or max_num_seqs, or use a smaller model or dtype")
    return MemoryPlan(budget, budget // per_block, per_block, "measured", util, report)


def plan_memory(model: CausalLM, spec: KVCacheSpec, config: EngineConfig, device: torch.device,
                attention: AttentionBackend) -> MemoryPlan:
    """The engine's plan, logged at INFO. Measures (profiling forwards through `attention`, device memory)
    only on CUDA when neither num_kv_blocks nor kv_cache_memory is set; the device is back to its state
    before the call, except for what the forwards leave behind (workspaces, compiled kernels)."""
    report = None
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
        report = measure_device_memory(model, spec, config, device, attention)
    plan = plan_kv_cache(report, config, spec)
    logger.info("memory plan: %s", plan.describe())
    return plan


def measure_device_memory(model: CausalLM, spec: KVCacheSpec, config: EngineConfig, device: torch.device,
                          attention: AttentionBackend) -> DeviceMemoryReport:
    """CUDA only: profile the activations of the largest step and, when decode graphs will be captured,
    of the largest decode graph (its private pool holds about that much), then read the device's total
    and used memory (after freeing the profiles' cache blocks)."""
    profile = profile_peak_activation_bytes(model, spec, config, device, attention)
    graph_bytes = 0
    if not config.enforce_eager and attention.supports_decode_graphs:
        decode_step = profile_peak_activation_bytes(model, spec, config, device, attention,
                                                    lengths=[1] * config.max_num_seqs)
        graph_bytes = decode_step.peak_bytes or 0
        if mixed_graphs_apply(model, attention, config, device):
            graph_bytes += profile.peak_bytes or 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = model_weight_bytes(model)
    return DeviceMemoryReport(
        total_bytes=total, other_bytes=max(0, total - free - weights), weights_bytes=weights,
        activation_bytes=profile.peak_bytes or 0, graph_pool_bytes=graph_bytes or 0,
        profiled_tokens=profile.num_tokens)


def profile_peak_activation_bytes(model: CausalLM, spec: KVCacheSpec, config: EngineConfig, device: torch.device,
                                  attention: AttentionBackend | None = None,
                                  lengths: list[int] | None = None) -> ActivationProfile:
    """Run one forward of the largest step through ModelRunner.execute: max_num_batched_tokens tokens
    (capped by max_num_seqs sequences of at most the model's longest length), one sequence per
    dummy prompt, each sampling one row (the longest prompt first, then one-token prompts up to
    max_num_seqs rows). A temporary KVCache just big enough holds their K/V; every block is returned
    and the cache dropped before this returns. On CUDA, peak_bytes is the peak allocated during the
    forward minus what was allocated before it (the temporary cache is in neither); elsewhere None."""
    lengths = lengths or dummy_prompt_lengths(config.max_num_batched_tokens, _longest_prompt(model, config),
                                              config.max_num_seqs)
    num_blocks = sum(-(-n // spec.block_size) for n in lengths)
    cache = KVCache(spec, num_blocks, device, enable_prefix_caching=False)
    runner = ModelRunner(model, cache, Sampler(0), device, attention=attention)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = [Sequence(f"profile-{i}", [0] * n, params) for i, n in enumerate(lengths)]
    cuda = device.type == "cuda"
    try:
        for seq in seqs:
            seq.block_table = cache.allocator.allocate(-(-seq.num_tokens // spec.block_size))
        if cuda:  # a first small prefill: kernels compile and autotune (Triton's timing buffers) outside the peak
            runner.execute([ScheduledChunk(seqs[0], min(16, seqs[0].num_tokens))])
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        runner.execute([ScheduledChunk(seq, seq.num_tokens) for seq in seqs])
        if cuda:
            torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    finally:
        for seq in seqs:
            cache.allocator.free(seq.block_table or [])
            seq.block_table = []
    free_after = cache.allocator.num_free_blocks
    del runner, cache
    if cuda:
        torch.cuda.empty_cache()
    return ActivationProfile(sum(lengths), len(lengths), num_blocks, free_after, peak)


def dummy_prompt_lengths(num_tokens: int, max_len: int, max_seqs: int) -> list[int]:
    """Prompt lengths of the profiling step: min(num_tokens, max_seqs x max_len) tokens in all, none
    longer than max_len, in as many prompts as max_seqs allows (each samples one logits row), the
    longest first."""
    total = min(num_tokens, max_seqs * max_len)
    count = min(max_seqs, total)
    lengths, left = [], total
    for i in range(count):
        take = min(max_len, left - (count - i - 1))
        lengths.append(take)
        left -= take
    return lengths


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each storage counted once (tied embeddings share one)."""
    seen, total = set(), 0
    for param in model.parameters():
        storage = param.untyped_storage()
        key = (param.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _longest_prompt(model: CausalLM, config: EngineConfig) -> int:
    """The longest sequence the engine may serve before the pool caps it (model, user, sliding window)."""
    cfg = model.config
    limits = [cfg.max_position_embeddings]
    if config.max_model_len is not None:
        limits.append(config.max_model_len)
    if cfg.sliding_window is not None:
        limits.append(cfg.sliding_window)
    return min(limits)


def _terms(report: DeviceMemoryReport, util: float) -> str:
    return (f"{util:g} x {_gib(report.total_bytes)} GiB = {_gib(int(util * report.total_bytes))} GiB usable, "
            f"other {_gib(report.other_bytes)} GiB, weights {_gib(report.weights_bytes)} GiB, "
            f"activations at {report.profiled_tokens} tokens {_gib(report.activation_bytes)} GiB, "
            f"CUDA graphs {_gib(report.graph_pool_bytes)} GiB")


def _crowding(crowding: int) -> str:
    return f", and other use past the headroom takes {_gib(crowding)} GiB," if crowding else ""


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f}"
