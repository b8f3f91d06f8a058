"""The engine against the machine: its memory plan, prefill TFLOP/s against bare matmuls of the same shapes,
decode ms/step against the weight-read floor (cluster/bench/limits.py measures; this words the rows).

They measure one engine (SelftestContext.perf_llm: the perf shape, bf16 on CUDA, float32 on CPU). Timings
never fail a check; a check fails when it cannot measure (or measures no number), or when the plan breaks
its own arithmetic or the device holds more than the plan allows.
"""
from __future__ import annotations

import math

import torch

from cluster.selftest.context import transformers_missing
from cluster.selftest.results import Outcome, passed, skipped, verdict

GIB = float(1 << 30)
DEVICE_SLACK = 0.02  # of the device's memory: what the used-memory check allows above the plan's cap


def check_memory_plan(ctx) -> Outcome:
    if reason := transformers_missing():
        return skipped(reason)
    llm = ctx.perf_llm()
    engine = llm.engine
    plan, config = engine.memory_plan, engine.config
    pool_bytes = engine.kv_cache.kv.numel() * engine.kv_cache.kv.element_size()
    problems = []
    if pool_bytes != plan.num_blocks * plan.bytes_per_block:
        problems.append(f"pool tensor {pool_bytes} B != {plan.num_blocks} blocks x {plan.bytes_per_block} B")
    if plan.num_blocks < 1 or (plan.source == "measured" and plan.num_blocks < config.max_num_seqs):
        problems.append(f"{plan.num_blocks} blocks for max_num_seqs {config.max_num_seqs}")
    metrics = dict(source=plan.source, num_blocks=plan.num_blocks, bytes_per_block=plan.bytes_per_block,
                   kv_budget_bytes=plan.kv_budget_bytes, max_model_len=engine.max_model_len)
    detail = f"{ctx.sizes.perf_shape} {ctx.perf_dtype}: {plan.describe()}"
    if ctx.cuda:
        use, over = _device_use(engine, plan, metrics)
        detail += "; " + use
        problems += over
    if problems:
        detail += "; " + "; ".join(problems)
    return verdict(not problems, detail, **metrics)


def _device_use(engine, plan, metrics: dict) -> tuple[str, list[str]]:
    """The device's memory in use after the engine started against what its plan allows: this engine's
    share (gpu_memory_utilization x total) plus what others held when it measured, up to the headroom the
    share leaves (engine/runner/memory_plan.py). Returns (the numbers in words, problems: none unless measured
    and over)."""
    free, total = torch.cuda.mem_get_info(engine.device)
    used, util = total - free, engine.config.gpu_memory_utilization
    others = plan.report.other_bytes if plan.report is not None else 0
    allowed = util * total + min(others, (1 - util) * total)
    metrics.update(device_used_bytes=used, device_total_bytes=total, device_allowed_bytes=int(allowed))
    words = (f"device in use after start {used / GIB:.2f} GiB, the plan allows {allowed / GIB:.2f} GiB "
             f"({util:g} x {total / GIB:.0f} GiB + others' {min(others, (1 - util) * total) / GIB:.2f})")
    if plan.source == "measured" and used > allowed + DEVICE_SLACK * total:
        return words, [f"the device holds {(used - allowed) / GIB:.2f} GiB more than the plan allows"]
    return words, []


def check_prefill(ctx) -> Outcome:
    if reason := transformers_missing():
        return skipped(reason)
    from cluster.bench.limits import prefill_flops, prefill_row

    llm = ctx.perf_llm()
    sizes = ctx.sizes
    row = prefill_row(llm, sizes.prefill_prompts, sizes.prefill_len, repeats=5)
    flops = prefill_flops(llm.engine.runner.model, sizes.prefill_prompts * sizes.prefill_len, sizes.prefill_prompts)
    engine_tflops, matmul_tflops = flops / row.engine_ms / 1e9, flops / row.floor_ms / 1e9
    detail = (f"prefill {sizes.prefill_prompts}x{sizes.prefill_len}: {engine_tflops:.3g} TFLOP/s vs matmul "
              f"{matmul_tflops:.3g} ({engine_tflops / matmul_tflops:.0%}); "
              f"{row.engine_ms:.1f} ms vs {row.floor_ms:.1f} ms")
    return _timed(detail, [row.engine_ms, row.floor_ms], engine_ms=row.engine_ms, matmul_ms=row.floor_ms,
                  engine_tflops=engine_tflops, matmul_tflops=matmul_tflops, flops=flops)


def check_decode(ctx, batch: int) -> Outcome:
    if reason := transformers_missing():
        return skipped(reason)
    from cluster.bench.limits import decode_floor, decode_row

    llm = ctx.perf_llm()
    floor_ms, floor = ctx.shared("decode floor", lambda: decode_floor(llm))
    sizes = ctx.sizes
    row = decode_row(llm, batch, floor_ms, floor, sizes.decode_context, sizes.decode_steps)
    detail = (f"decode b={batch} x {sizes.decode_context} ctx: {row.engine_ms:.2f} ms/step vs floor "
              f"{row.floor_ms:.3g} ms ({row.ratio:.1f}x; {floor})")
    return _timed(detail, [row.engine_ms, row.floor_ms], step_ms=row.engine_ms, floor_ms=row.floor_ms,
                  ratio=row.ratio, steps=sizes.decode_steps, context=sizes.decode_context)


def _timed(detail: str, times: list[float], **metrics) -> Outcome:
    """PASS whatever the speed; FAIL only when a time is not a number. A time <= 0 (a difference of two
    runs lost in noise) is flagged in the detail."""
    if not all(math.isfinite(t) for t in times):
        return verdict(False, detail + "; a timing is not finite", **metrics)
    if not all(t > 0 for t in times):
        detail += " (not positive: lost in timing noise; rerun without --quick)"
    return passed(detail, **metrics)
