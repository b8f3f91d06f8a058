"""The `tandem` command: serve, client, demo, bench."""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    from deploy import demo
    demo_parser = commands.add_parser("demo", help="generate for a few prompts and print tokens/s and TTFT")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    from cluster import client, serve
    serve_parser = commands.add_parser("serve", help="gRPC + OpenAI-compatible HTTP front ends")
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(run=serve.run)
    client_parser = commands.add_parser("client", help="stream a completion from a Tandem gRPC server")
    client.add_arguments(client_parser)
    client_parser.set_defaults(run=client.run)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from cluster import bench_engine
    engine_parser = bench.add_parser("engine", help="engine.LLM vs transformers on a serving-like mix")
    bench_engine.add_arguments(engine_parser)
    engine_parser.set_defaults(run=bench_engine.run)
    from cluster import bench_serve
    serve_bench_parser = bench.add_parser("serve", help="load a running server; vLLM's serving metrics")
    bench_serve.add_arguments(serve_bench_parser)
    serve_bench_parser.set_defaults(run=bench_serve.run)
    from kv_transfer import bench as bench_transfer
    transfer_parser = bench.add_parser("transfer", help="KV transfer GB/s against a raw loopback socket")
    bench_transfer.add_arguments(transfer_parser)
    transfer_parser.set_defaults(run=bench_transfer.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
