"""`tandem serve`: the gRPC and OpenAI-compatible HTTP front ends over a backend, until SIGTERM/SIGINT.

Today the backend is one engine in this process (colocated serving: the same engine prefills and
decodes, with chunked prefill). Disaggregated serving over Ray-placed prefill and decode workers plugs
in behind the same Backend contract (cluster/backend.py); until it lands, asking for it is an error.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import dataclass

from cluster.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.http_server import HttpServerConfig, start_http_server
from cluster.local_backend import LocalBackendConfig, LocalEngineBackend
from cluster.metrics import ServingMetrics


@dataclass(frozen=True)
class ServeConfig:
    model: str | None
    dtype: str
    device: str
    mode: str
    prefill_workers: int
    decode_workers: int
    host: str
    grpc_port: int
    http_port: int
    api_key: str | None
    max_pending_requests: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    parser.add_argument("--prefill-workers", type=int, default=0)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "grpc", "ipc"])
    parser.add_argument("--address", default=None, help="Ray cluster address (disaggregated mode)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require this key on gRPC and HTTP requests")
    parser.add_argument("--max-pending-requests", type=int, default=256)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if args.mode == "disaggregated" or args.prefill_workers:
        raise ValueError("disaggregated serving needs the Ray-placed prefill/decode workers, which are "
                         "not in this build yet; run --mode colocated")
    if args.decode_workers != 1:
        raise ValueError("colocated serving runs one engine in this process: use --decode-workers 1")
    return ServeConfig(args.model, args.dtype, args.device, args.mode, args.prefill_workers,
                       args.decode_workers, args.host, args.grpc_port, args.http_port, args.api_key,
                       args.max_pending_requests)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    asyncio.run(serve(config))
    return 0


async def serve(config: ServeConfig) -> None:
    """Start the backend and both front ends, print where they listen, run until SIGTERM/SIGINT,
    then stop the front ends, abort what is in flight and stop the engine thread."""
    from engine import LLM
    engine = LLM(model=config.model, dtype=config.dtype, device=config.device).engine
    name = config.model or "tandem-default"
    backend = LocalEngineBackend(engine, LocalBackendConfig(
        model_name=name, max_pending_requests=config.max_pending_requests))
    metrics = ServingMetrics()
    grpc_server, grpc_port = await start_grpc_server(
        backend, GrpcServerConfig(host=config.host, port=config.grpc_port, api_key=config.api_key), metrics)
    http_runner, http_port = await start_http_server(
        backend, HttpServerConfig(host=config.host, port=config.http_port, api_key=config.api_key), metrics)
    print(f"tandem serving {name} ({config.mode}): gRPC {config.host}:{grpc_port}, "
          f"HTTP http://{config.host}:{http_port}/v1", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
    finally:
        print("tandem: shutting down", flush=True)
        await grpc_server.stop(grace=2.0)
        await http_runner.cleanup()
        await backend.shutdown()
