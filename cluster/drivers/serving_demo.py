"""The serving demo (`tandem demo`, default mode): the same mixed workload through the real gRPC front
end, once disaggregated (prefill and decode worker actors on a local Ray) and once colocated (one
engine in this process), side by side.

Workers: on a machine with >= 2 GPUs, half of them prefill and half decode (the colocated engine then
takes one GPU); otherwise one prefill and one decode CPU worker (and a CPU colocated engine).
Disaggregated runs first, so its GPUs are released before the colocated engine loads.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass

from cluster.drivers.grpc_workload import (RequestResult, WorkloadRequest, WorkloadSummary, chat_renderer,
                                           mixed_workload, run_workload, summarize)
from engine.builder import describe_model

CPU_POOL_BYTES = 256 << 20  # the KV pool of each CPU engine: 12 requests of SmolLM2 (720 KiB a block) fit in it
POOL_DRAIN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class DemoPlan:
    """Where the demo runs: device for every engine and the disaggregated worker counts."""

    device: str
    num_prefill_workers: int
    num_decode_workers: int
    model: str | None
    dtype: str
    num_requests: int
    max_tokens: int
    gpus_per_worker: float = 1.0  # 0.5: prefill and decode workers share the one GPU (KV over CUDA IPC)

    @property
    def kv_cache_memory(self) -> int | None:
        return CPU_POOL_BYTES if self.device == "cpu" else None


def plan_from_args(args: argparse.Namespace) -> DemoPlan:
    """Half the local GPUs prefill and half decode when there are >= 2; one prefill and one decode worker
    sharing the GPU when there is one; else 1 + 1 CPU workers."""
    import torch
    gpus = torch.cuda.device_count() if args.device in ("auto", "cuda") else 0
    common = (args.model, args.dtype, args.requests, args.max_tokens)
    if gpus >= 2:
        return DemoPlan("cuda", gpus // 2, gpus - gpus // 2, *common)
    if gpus == 1:
        return DemoPlan("cuda", 1, 1, *common, gpus_per_worker=0.5)
    if args.device == "cuda":
        raise ValueError("the serving demo on cuda needs a GPU")
    return DemoPlan("cpu", 1, 1, *common)


def run_serving(args: argparse.Namespace) -> int:
    """Run both modes, print the table and the pool check; 0 when every request finished and every
    KV pool is empty."""
    plan = plan_from_args(args)
    logging.getLogger("tandem").setLevel(logging.WARNING)
    print(f"serving demo: {describe_model(plan.model)} on "
          f"{plan.device}; disaggregated = {plan.num_prefill_workers} prefill + {plan.num_decode_workers} decode "
          f"workers on a local Ray, colocated = one engine in this process; {plan.num_requests} concurrent "
          f"requests via gRPC 127.0.0.1", flush=True)
    workload = mixed_workload(plan.num_requests, plan.max_tokens, chat_renderer(plan.model))
    rows, answers, pools_empty = asyncio.run(_run_modes(plan, workload))
    print_table(rows)
    print_answers(workload, answers)
    return 0 if pools_empty and all(s.failed == 0 for _, s in rows) else 1


async def _run_modes(plan: DemoPlan, workload: list[WorkloadRequest]
                     ) -> tuple[list[tuple[str, WorkloadSummary]], list[RequestResult], bool]:
    """Both modes on the same workload: their summaries, the disaggregated run's results, whether every pool
    ended empty."""
    rows, pool_lines = [], []
    disaggregated, summary, pools = await _run_disaggregated(plan, workload)
    rows.append(("disaggregated", summary))
    pool_lines.append(pools)
    _, summary, pools = await _run_colocated(plan, workload)
    rows.append(("colocated", summary))
    pool_lines.append(pools)
    empty = all(ok for ok, _ in pool_lines)
    print(f"KV pools {'empty' if empty else 'NOT EMPTY'}: " + "; ".join(text for _, text in pool_lines), flush=True)
    return rows, disaggregated, empty


def print_answers(workload: list[WorkloadRequest], results: list[RequestResult], count: int = 3) -> None:
    """The first `count` questions and what the disaggregated run answered, one line each, and the first long
    one's (a summary), so a person sees it answer."""
    shown = [i for i in range(min(count, len(workload)))] + [i for i in range(count, len(workload))
                                                              if len(workload[i].question) > 200][:1]
    print("\nanswers streamed through disaggregated serving:")
    for index in shown:
        text = workload[index].question
        context, _, ask = text.rpartition("\n")
        question = f"[{len(context)} characters of text] {ask}" if context else " ".join(text.split())
        answer = " ".join(results[index].text.split()) or f"(no text: {results[index].error})"
        print(f"  Q: {question}\n  A: {answer}", flush=True)


async def _serve_workload(backend, workload: list[WorkloadRequest]) -> tuple[list[RequestResult], float]:
    """The gRPC front end on 127.0.0.1:0 over `backend`, the workload through it, then the front end stops."""
    from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
    server, port = await start_grpc_server(backend, GrpcServerConfig(host="127.0.0.1", port=0))
    try:
        return await run_workload(f"127.0.0.1:{port}", workload)
    finally:
        await server.stop(grace=2.0)


async def _run_disaggregated(plan: DemoPlan, workload: list[WorkloadRequest]
                             ) -> tuple[list[RequestResult], WorkloadSummary, tuple[bool, str]]:
    import ray

    from cluster.coordinator.start import start_cluster
    from cluster.workers.cluster_config import ClusterConfig
    from engine import EngineConfig
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,  # its own
             logging_level=logging.ERROR, num_cpus=max(os.cpu_count() or 1, plan.num_prefill_workers
                                                         + plan.num_decode_workers + 1))
    try:
        config = ClusterConfig(model=plan.model, dtype=plan.dtype, device=plan.device,
                               num_prefill_workers=plan.num_prefill_workers,
                               num_decode_workers=plan.num_decode_workers,
                               engine=EngineConfig(kv_cache_memory=plan.kv_cache_memory), worker_start_timeout_s=120.0,
                               gpus_per_worker=plan.gpus_per_worker)
        coordinator = await asyncio.to_thread(start_cluster, config)
        try:
            results, wall_s = await _serve_workload(coordinator, workload)
            pools = await drain_worker_pools(coordinator)
        finally:
            await coordinator.shutdown()
    finally:
        ray.shutdown()
    _print_failures("disaggregated", results)
    return results, summarize(results, wall_s), pools


async def drain_worker_pools(coordinator) -> tuple[bool, str]:
    """Waits (bounded) until every worker's pool is whole; (all empty, 'name free/total, ...')."""
    deadline = time.monotonic() + POOL_DRAIN_TIMEOUT_S
    while True:
        stats = await coordinator.worker_stats()
        empty = all(s.free_blocks == s.total_blocks for s in stats.values())
        if empty or time.monotonic() > deadline:
            text = ", ".join(f"{name} {s.free_blocks}/{s.total_blocks}" for name, s in sorted(stats.items()))
            return empty, f"{text} blocks free"
        await asyncio.sleep(0.05)


async def _run_colocated(plan: DemoPlan, workload: list[WorkloadRequest]
                         ) -> tuple[list[RequestResult], WorkloadSummary, tuple[bool, str]]:
    from cluster.local.backend import LocalBackendConfig, LocalEngineBackend
    from engine import LLM
    engine = LLM(model=plan.model, dtype=plan.dtype, device=plan.device,
                 kv_cache_memory=plan.kv_cache_memory).engine
    backend = LocalEngineBackend(engine, LocalBackendConfig(model_name=plan.model or "tandem-default"))
    try:
        results, wall_s = await _serve_workload(backend, workload)
        deadline = time.monotonic() + POOL_DRAIN_TIMEOUT_S
        while engine.num_free_blocks != engine.num_total_blocks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await backend.shutdown()
    free, total = engine.num_free_blocks, engine.num_total_blocks
    engine.close()
    _print_failures("colocated", results)
    return results, summarize(results, wall_s), (free == total, f"colocated engine {free}/{total} blocks free")


def _print_failures(mode: str, results: list[RequestResult]) -> None:
    for result in results:
        if result.error is not None:
            print(f"{mode}: {result.request_id} failed: {result.error}", flush=True)


def print_table(rows: list[tuple[str, WorkloadSummary]]) -> None:
    """One row per mode: TTFT and ITL percentiles (client-side), tokens/s, transfer share, KV bytes."""
    header = (f"{'mode':<14}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'tok/s':>8}"
              f"{'xfer/TTFT p50':>15}{'KV bytes':>11}{'failed':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    for mode, s in rows:
        share = f"{s.transfer_share_p50:.1%}" if mode == "disaggregated" else "-"
        kv = f"{s.kv_bytes:,}" if mode == "disaggregated" else "-"
        print(f"{mode:<14}{s.ttft_p50:>8.1f}ms{s.ttft_p99:>8.1f}ms{s.itl_p50:>7.1f}ms{s.itl_p99:>7.1f}ms"
              f"{s.tokens_per_s:>8.1f}{share:>15}{kv:>11}{s.failed:>8}")
    print("(latencies measured at the gRPC client; xfer/TTFT = timing.transfer_exposed_ms / timing.ttft_ms, "
          "the transfer's part of TTFT after the prefill (layer-streamed, the rest runs under it); "
          "one run on a shared machine, so read ratios, not absolutes)", flush=True)
