"""The `tandem` command: serve, client, scale, demo, convert, bench, plan, selftest."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With `argv`, only the module of the command it names is imported (the others
    list their help text): `tandem --help`, `tandem bench serve` or `tandem scale` start without torch. Without
    it, every command's module is imported (each adds its own arguments)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    selected = None if argv is None else _named_command(argv)
    add, add_bench = _command_adder(selected, ()), _command_adder(selected, ("bench",))
    add(commands, "demo", "cluster.drivers.demo",
        "serve a mixed workload disaggregated and colocated, side by side")
    add(commands, "serve", "cluster.serve", "gRPC + OpenAI-compatible HTTP front ends")
    add(commands, "client", "cluster.clients.generate", "stream a completion from a Tandem gRPC server")
    add(commands, "convert", "cluster.drivers.convert",
        "write a GGUF file as a Hugging Face checkpoint directory (config, safetensors, tokenizer)")
    add(commands, "scale", "cluster.clients.scale",
        "add or drain workers of a running server (POST /admin/workers), or list them")
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_bench(bench, "engine", "cluster.bench.engine_vs_hf", "engine.LLM vs transformers on a serving-like mix")
    add_bench(bench, "serve", "cluster.bench.serve", "load a running server; vLLM's serving metrics")
    add_bench(bench, "peer", "cluster.bench.peer",
        "Tandem's serving modes against a peer's OpenAI server (vLLM's), same model and client, one run")
    add_bench(bench, "compare", "cluster.bench.compare",
        "every serving mode on the same workload: table and plots")
    add_bench(bench, "transfer", "cluster.bench.transfer",
        "KV transfer GB/s against a raw loopback socket; --streaming: the transfer layer streaming hides")
    add_bench(bench, "load", "cluster.bench.load",
        "a model's load time to its first token, stage by stage, in fresh processes")
    add_bench(bench, "sampler", "cluster.bench.sampler",
        "engine.sampling.sampler.Sampler alone: ms per call per sampling mode")
    add_bench(bench, "structured", "cluster.bench.structured",
        "structured outputs: a decode step with every row constrained vs none, new vs cached schema TTFT")
    add_bench(bench, "tp", "cluster.bench.tensor_parallel",
        "a tensor-parallel engine's step time against TP=1 on the same cores, side by side")
    add_bench(bench, "memory", "cluster.bench.memory_stress",
        "many decodes with a long prompt arriving, on a random model of a real shape: memory and steps")
    add(commands, "plan", "cluster.plan.command",
        "which P:D split (or colocated replicas) to run: profile, simulate, recommend")
    add(commands, "selftest", "cluster.selftest.command",
        "check this machine: kernels, greedy vs transformers, speed against its limits, KV transports")
    return parser


def _named_command(argv: Sequence[str]) -> tuple[str, ...]:
    """The command `argv` names: ("serve",), ("bench", "serve"), or () when it names none (`tandem --help`)."""
    words = [word for word in argv if not word.startswith("-")][:2]
    return tuple(words[:2]) if words[:1] == ["bench"] else tuple(words[:1])


def _command_adder(selected: tuple[str, ...] | None, parent: tuple[str, ...]):
    """_add_command for the commands under `parent` (() or ("bench",)) that imports a command's module only when
    it is the `selected` one (None: every one); the others get their help text alone."""
    def add(subparsers, name: str, module_name: str, help_text: str) -> None:
        path = (*parent, name)
        if selected is None or path == selected[:len(path)]:
            _add_command(subparsers, name, module_name, help_text)
        else:
            subparsers.add_parser(name, help=help_text)
    return add


def _add_command(subparsers, name: str, module_name: str, help_text: str) -> None:
    """A subcommand whose module provides add_arguments(parser) and run(args) -> exit code. A module that
    cannot be imported here (a dependency missing on this machine) leaves its command in place, saying why
    when it is run, so the other commands (`tandem selftest` on a machine without Ray) still work."""
    command = subparsers.add_parser(name, help=help_text)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        command.set_defaults(run=_unavailable(name, exc), unavailable=True)
        return
    module.add_arguments(command)
    command.set_defaults(run=module.run)


def _unavailable(name: str, exc: ImportError):
    def run(args) -> int:
        print(f"tandem {name}: unavailable on this machine: {exc}", file=sys.stderr)
        return 2
    return run


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):  # an unavailable command takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
