"""The `ray job submit` job (deploy/job.py runs it): serve disaggregated on the Ray cluster's resources
and send N requests.

    ray job submit --address http://HEAD:8265 --working-dir . -- python deploy/job.py --requests 8

Inside a Ray job (RAY_ADDRESS is set for the job's driver) it joins that cluster; stand-alone (no
RAY_ADDRESS, no --address) it starts a local Ray on 127.0.0.1 and stops it at the end. It starts the
prefill and decode workers (counts from the flags, or half / half of the cluster's GPUs, or 1 + 1 CPU
workers), the gRPC front end on 127.0.0.1:0, sends the requests through the gRPC client concurrently,
prints one row per request, shuts down what it started and exits 0, or 1 if any request failed or a
worker's KV pool did not end empty.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass

from cluster.drivers.grpc_workload import RequestResult, chat_renderer, mixed_workload, run_workload, summarize
from cluster.workers.cluster_config import KV_HOST_GONE
from engine.builder import describe_model


@dataclass(frozen=True)
class JobPlan:
    """What the job starts: model, worker counts (0 = from the cluster's resources), transport."""

    model: str | None
    dtype: str
    address: str | None
    num_requests: int
    max_tokens: int
    prefill_workers: int
    decode_workers: int
    transport: str
    kv_cache_memory: int | None
    device: str = "auto"


def parse_args(argv: list[str] | None = None) -> JobPlan:
    parser = argparse.ArgumentParser(prog="deploy/job.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint directory or GGUF file on every node; 'tiny': the embedded "
                             "model (default: SmolLM2 where installed)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prefill-workers", type=int, default=0, help="0: half the GPUs, or 1 on CPU")
    parser.add_argument("--decode-workers", type=int, default=0, help="0: the other half of the GPUs, or 1")
    parser.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "grpc", "ipc"])
    parser.add_argument("--kv-host", default=None, help=KV_HOST_GONE)
    parser.add_argument("--kv-cache-mib", type=int, default=None, help="KV pool per worker (default: engine's)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: GPUs as below when the cluster has them, else CPU")
    args = parser.parse_args(argv)
    if args.kv_host is not None:
        print(f"deploy/job.py: warning: {KV_HOST_GONE}", file=sys.stderr)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    memory = args.kv_cache_mib << 20 if args.kv_cache_mib else None
    return JobPlan(args.model, args.dtype, args.address or os.environ.get("RAY_ADDRESS"), args.requests,
                   args.max_tokens, args.prefill_workers, args.decode_workers, args.transport, memory,
                   args.device)


def connect(plan: JobPlan) -> None:
    """Join the job's (or --address) cluster, or start a local Ray of its own on 127.0.0.1 (address "local": never
    another Ray this machine runs, which ray.init() would otherwise join and then refuse the num_cpus given)."""
    import ray
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    if plan.address:
        ray.init(address=plan.address, **quiet)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, 3), **quiet)


def worker_counts(plan: JobPlan) -> tuple[int, int, str, int | None, float]:
    """(prefill, decode, device, kv_cache_memory, gpus_per_worker): flags win; else half / half of the GPUs
    when there are >= 2, one prefill and one decode worker sharing the GPU when there is one, else one CPU
    worker each with a small pool. --device cpu ignores the GPUs; --device cuda insists on them."""
    import ray
    gpus = 0 if plan.device == "cpu" else int(ray.cluster_resources().get("GPU", 0))
    if plan.prefill_workers and plan.decode_workers:
        prefill, decode = plan.prefill_workers, plan.decode_workers
    elif gpus >= 2:
        prefill, decode = gpus // 2, gpus - gpus // 2
    else:
        prefill, decode = 1, 1
    share = 1.0 if gpus != 1 else 1.0 / (prefill + decode)
    device = "cuda" if gpus >= prefill + decode or gpus == 1 or plan.device == "cuda" else "cpu"
    memory = plan.kv_cache_memory or (32 << 20 if device == "cpu" else None)
    return prefill, decode, device, memory, share


async def serve_and_send(plan: JobPlan) -> tuple[list[RequestResult], float, bool]:
    """Start the cluster and the gRPC front end, send the requests, check the pools, stop both."""
    from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
    from cluster.coordinator.start import start_cluster
    from cluster.workers.cluster_config import ClusterConfig
    from engine import EngineConfig
    prefill, decode, device, memory, share = worker_counts(plan)
    config = ClusterConfig(model=plan.model, dtype=plan.dtype, device=device, num_prefill_workers=prefill,
                           num_decode_workers=decode, transport=plan.transport,
                           engine=EngineConfig(kv_cache_memory=memory), worker_start_timeout_s=300.0,
                           gpus_per_worker=share)
    print(f"tandem job: {describe_model(plan.model)}, {prefill} prefill + {decode} "
          f"decode workers on {device}, {plan.num_requests} requests x {plan.max_tokens} tokens", flush=True)
    coordinator = await asyncio.to_thread(start_cluster, config)
    try:
        server, port = await start_grpc_server(coordinator, GrpcServerConfig(host="127.0.0.1", port=0))
        try:
            workload = mixed_workload(plan.num_requests, plan.max_tokens, chat_renderer(plan.model))
            results, wall_s = await run_workload(f"127.0.0.1:{port}", workload)
        finally:
            await server.stop(grace=2.0)
        from cluster.drivers.serving_demo import drain_worker_pools
        pools_empty, pools_text = await drain_worker_pools(coordinator)
        print(f"KV pools {'empty' if pools_empty else 'NOT EMPTY'}: {pools_text}", flush=True)
    finally:
        await coordinator.shutdown()
    return results, wall_s, pools_empty


def print_requests(results: list[RequestResult], wall_s: float) -> None:
    """One row per request: TTFT at the client and the server's breakdown, tokens, tokens/s."""
    header = (f"{'request':<8}{'prompt':>7}{'TTFT':>9}{'queue':>8}{'prefill':>9}{'xfer exp':>10}"
              f"{'out tok':>8}{'tok/s':>8}  workers")
    print("\n" + header + "\n" + "-" * (len(header) + 18))
    for r in results:
        if r.error is not None:
            print(f"{r.request_id:<8}{r.prompt_chars:>7}  FAILED: {r.error}")
            continue
        t = r.timing
        rate = r.output_tokens / r.elapsed_s if r.elapsed_s > 0 else 0.0
        print(f"{r.request_id:<8}{r.prompt_chars:>7}{r.ttft_ms:>7.1f}ms{t.queue_ms:>6.1f}ms{t.prefill_ms:>7.1f}ms"
              f"{t.transfer_exposed_ms:>8.1f}ms{r.output_tokens:>8}{rate:>8.1f}  {t.prefill_worker}->{t.decode_worker}")
    s = summarize(results, wall_s)
    print(f"\n{len(results) - s.failed}/{len(results)} ok; TTFT p50 {s.ttft_p50:.1f} ms, p99 {s.ttft_p99:.1f} ms; "
          f"{s.tokens_per_s:.1f} tokens/s overall; exposed KV transfer {s.transfer_share_p50:.1%} of TTFT (p50); "
          f"{s.kv_bytes:,} KV bytes", flush=True)


def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import ray
    connect(plan)
    try:
        results, wall_s, pools_empty = asyncio.run(serve_and_send(plan))
    finally:
        ray.shutdown()
    print_requests(results, wall_s)
    return 0 if pools_empty and all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
