"""The `tandem` command: serve, client, demo, bench."""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from cluster import client, serve
    from cluster.bench import compare as bench_compare
    from cluster.bench import engine_vs_hf as bench_engine
    from cluster.bench import sampler as bench_sampler
    from cluster.bench import serve as bench_serve
    from cluster.drivers import demo
    from kv_transfer import bench as bench_transfer

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_command(commands, "demo", demo, "serve a mixed workload disaggregated and colocated, side by side")
    _add_command(commands, "serve", serve, "gRPC + OpenAI-compatible HTTP front ends")
    _add_command(commands, "client", client, "stream a completion from a Tandem gRPC server")
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _add_command(bench, "engine", bench_engine, "engine.LLM vs transformers on a serving-like mix")
    _add_command(bench, "serve", bench_serve, "load a running server; vLLM's serving metrics")
    _add_command(bench, "compare", bench_compare, "every serving mode on the same workload: table and plots")
    _add_command(bench, "transfer", bench_transfer, "KV transfer GB/s against a raw loopback socket")
    _add_command(bench, "sampler", bench_sampler, "engine.sampler.Sampler alone: ms per call per sampling mode")
    return parser


def _add_command(subparsers, name: str, module, help_text: str) -> None:
    """A subcommand whose module provides add_arguments(parser) and run(args) -> exit code."""
    command = subparsers.add_parser(name, help=help_text)
    module.add_arguments(command)
    command.set_defaults(run=module.run)


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
