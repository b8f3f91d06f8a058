"""The `tandem` command: serve, client, scale, demo, convert, bench, plan, selftest."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence


# (command path, module, help): a module provides add_arguments(parser) and run(args); None: a group of commands
COMMANDS = (
    (("demo",), "cluster.drivers.demo", "serve a mixed workload disaggregated and colocated, side by side"),
    (("serve",), "cluster.serve", "gRPC + OpenAI-compatible HTTP front ends"),
    (("client",), "cluster.clients.generate", "stream a completion from a Tandem gRPC server"),
    (("convert",), "cluster.drivers.convert",
     "write a GGUF file as a Hugging Face checkpoint directory (config, safetensors, tokenizer)"),
    (("scale",), "cluster.clients.scale",
     "add or drain workers of a running server (POST /admin/workers), or list them"),
    (("bench",), None, "benchmarks"),
    (("bench", "engine"), "cluster.bench.engine_vs_hf", "engine.LLM vs transformers on a serving-like mix"),
    (("bench", "serve"), "cluster.bench.serve", "load a running server; vLLM's serving metrics"),
    (("bench", "peer"), "cluster.bench.peer",
     "Tandem's serving modes against a peer's OpenAI server (vLLM's), same model and client, one run"),
    (("bench", "compare"), "cluster.bench.compare", "every serving mode on the same workload: table and plots"),
    (("bench", "transfer"), "cluster.bench.transfer",
     "KV transfer GB/s against a raw loopback socket; --streaming: the transfer layer streaming hides"),
    (("bench", "load"), "cluster.bench.load",
     "a model's load time to its first token, stage by stage, in fresh processes"),
    (("bench", "probes"), "cluster.bench.probes",
     "a running server's probes (health, metrics) timed while large requests arrive at once"),
    (("bench", "sampler"), "cluster.bench.sampler",
     "engine.sampling.sampler.Sampler alone: ms per call per sampling mode"),
    (("bench", "structured"), "cluster.bench.structured",
     "structured outputs: a decode step with every row constrained vs none, new vs cached schema TTFT"),
    (("bench", "tp"), "cluster.bench.tensor_parallel",
     "a tensor-parallel engine's step time against TP=1 on the same cores, side by side"),
    (("bench", "tp-lanes"), "cluster.bench.tp_lanes",
     "a KV hand-off between two tensor-parallel groups by lanes against through rank 0, side by side"),
    (("bench", "memory"), "cluster.bench.memory_stress",
     "many decodes with a long prompt arriving, on a random model of a real shape: memory and steps"),
    (("plan",), "cluster.plan.command", "which P:D split (or colocated replicas) to run: profile, simulate, recommend"),
    (("selftest",), "cluster.selftest.command",
     "check this machine: kernels, greedy vs transformers, speed against its limits, KV transports"),
)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With `argv`, only the module of the command it names is imported (the others
    list their help text): `tandem --help`, `tandem bench serve` or `tandem scale` start without torch. Without
    it, every command's module is imported (each adds its own arguments)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    groups = {(): parser.add_subparsers(dest="command", required=True)}
    selected = None if argv is None else _named_command(argv)
    for path, module_name, help_text in COMMANDS:
        subparsers, name = groups[path[:-1]], path[-1]
        if module_name is None:
            groups[path] = subparsers.add_parser(name, help=help_text).add_subparsers(dest=name, required=True)
        elif selected is None or path == selected[:len(path)]:
            _add_command(subparsers, name, module_name, help_text)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def _named_command(argv: Sequence[str]) -> tuple[str, ...]:
    """The command `argv` names: ("serve",), ("bench", "serve"), or () when it names none (`tandem --help`)."""
    words = [word for word in argv if not word.startswith("-")][:2]
    return tuple(words) if words[:1] == ["bench"] else tuple(words[:1])


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
