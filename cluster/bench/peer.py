"""`tandem bench peer`: Tandem's serving modes against a peer's OpenAI server, same model, same client, one run.

    tandem bench peer --peer-runner ../shared/peers/vllm-cpu.sh          # vLLM's CPU server as the peer
    tandem bench peer --peer-url http://127.0.0.1:8000                   # any running OpenAI-compatible server

The model is the trained default unless --model says otherwise; a GGUF file is converted once (`tandem convert`)
for a vLLM peer, which reads Hugging Face directories, while Tandem serves the file itself (the same float32
values). Servers run one after another: the peer, then each Tandem mode (--modes, `tandem serve` with its
defaults plus the mode's flags). Each gets the whole workload once with other token ids, unmeasured (neither
side runs cold, neither finds the measured prompts in its prefix cache), then the measured workload at each
--request-rates (vLLM's `random` dataset: 512 prompt tokens, 64 out, ignore_eos, Poisson arrivals), all through
the `tandem bench serve` client. A server that does not start, or whose requests all fail, is reported without
figures. --repeats N runs all of it N times, a round after another, and pairs each Tandem row with the peer's
run of its round (the machine's speed drifts while the servers take their turns), then sums the rounds up as
each ratio's median with every round's beside it. --results-dir gets results.md (the table, each Tandem row's ratios
to the peer at the same rate; with rounds, their summary), results.json, peer.png (TTFT p50, TPOT p50 and ITL p99
per server and rate, the first round) and every server's log.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

from cluster.bench.compare import parse_rates
from cluster.bench.compare_plots import require_matplotlib
from cluster.bench.compare_server import ServerProcess, ServerStartError
from cluster.bench.peer_report import PeerRun, format_markdown, runs_json, write_plot
from cluster.bench.peer_server import ExternalServer, VllmServer
from cluster.bench.serve import add_workload_arguments, check_counts, workload_from_args
from cluster.bench.serve_client import ClientConfig, ServerUnreachable, run_requests
from cluster.bench.serve_metrics import compute_metrics
from cluster.bench.serve_workloads import arrival_gaps, generate_requests

_REPLICAS = re.compile(r"^colocated-(\d+)$")
_DISAGG = re.compile(r"^disagg-(\d+)p(\d+)d$")
DEFAULT_MODES = "colocated,colocated-1,disagg-1p1d"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peer-runner", default=None, metavar="RUNNER",
                      help="start vLLM's OpenAI server through this runner (e.g. ../shared/peers/vllm-cpu.sh)")
    peer.add_argument("--peer-url", default=None, help="a running OpenAI-compatible server to compare against")
    parser.add_argument("--model", default="default",
                        help="'default' (the trained default), a GGUF file or a Hugging Face checkpoint directory")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help="Tandem's modes, comma-separated: colocated (the engine in the serve process), "
                             "colocated-<N> (N replicas on Ray), disagg-<P>p<D>d; 'none' for the peer alone")
    parser.add_argument("--serve-args", default="", help="extra `tandem serve` flags for every Tandem mode")
    parser.add_argument("--request-rates", default="1,3", help="comma-separated req/s, 'inf' = all at once")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: every server once per round, rounds one after another; each Tandem row's "
                             "ratios are to the peer's run of its round (the machine's speed drifts)")
    parser.add_argument("--results-dir", default="bench_results/peer")
    parser.add_argument("--server-start-timeout", type=float, default=600.0)
    add_workload_arguments(parser)
    parser.set_defaults(dataset_name="random", random_input_len=512, random_output_len=64, ignore_eos=True,
                        num_prompts=32, seed=7)


def tandem_mode_flags(name: str) -> list[str]:
    """The `tandem serve` flags of a mode name; ValueError for an unknown one."""
    if name == "colocated":
        return ["--mode", "colocated"]
    if match := _REPLICAS.match(name):
        return ["--mode", "colocated", "--replicas", match.group(1)]
    if match := _DISAGG.match(name):
        return ["--mode", "disaggregated", "--prefill-workers", match.group(1), "--decode-workers", match.group(2)]
    raise ValueError(f"unknown mode {name!r}: use colocated, colocated-<N> or disagg-<P>p<D>d")


def parse_mode_names(text: str) -> list[str]:
    names = [] if text.strip() == "none" else [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        tandem_mode_flags(name)
    if len(set(names)) != len(names):
        raise ValueError("--modes lists a mode twice")
    return names


def run(args: argparse.Namespace) -> int:
    """0 when every server ran (a peer or mode that could not start is reported, not fatal); ValueError for
    bad flags, before anything starts."""
    check_counts(args)
    require_matplotlib()
    rates, names = parse_rates(args.request_rates), parse_mode_names(args.modes)
    if args.peer_runner is None and args.peer_url is None and not names:
        raise ValueError("nothing to run: give --peer-runner or --peer-url, or Tandem --modes")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    model = _resolve_model(args.model)
    vocab_size = _vocab_size(model)
    workload = workload_from_args(args)
    samples = [generate_requests(workload, args.num_prompts, vocab_size, args.seed + 1000 * i)
               for i in range(len(rates))]
    warm = generate_requests(workload, args.num_prompts, vocab_size, args.seed + 999_999)  # other token ids
    results_dir = Path(args.results_dir)
    print(f"bench peer: {args.num_prompts} {args.dataset_name} requests x rates {args.request_rates}; model "
          f"{model}; servers: {'peer, ' if args.peer_runner or args.peer_url else ''}{', '.join(names)}", flush=True)
    runs: list[PeerRun] = []
    with tempfile.TemporaryDirectory(prefix="tandem-peer-") as tmp:
        peer_checkpoint = _hf_checkpoint(model, Path(tmp)) if args.peer_runner is not None else None
        for round_ in range(args.repeats):
            for name, server in _servers(args, model, peer_checkpoint, names, results_dir, round_):
                runs += [dataclasses.replace(run, round=round_)
                         for run in _measure(name, server, args, rates, samples, warm)]
    _write_results(runs, args, results_dir)
    return 0


def _resolve_model(model: str) -> str:
    from engine.builder import resolve_model
    return resolve_model(None if model == "default" else model)


def _vocab_size(model: str) -> int:
    from engine.builder import load_model_config
    return load_model_config(model).vocab_size


def _servers(args, model: str, peer_checkpoint: Path | None, names: list[str], results_dir: Path, round_: int):
    """(name, server context manager) of the peer and each Tandem mode, built lazily in run order; the logs of
    round r > 0 are server-<name>-<r + 1>.log."""
    suffix = "" if round_ == 0 else f"-{round_ + 1}"
    if args.peer_url is not None:
        yield "peer", ExternalServer(args.peer_url)
    elif args.peer_runner is not None:
        yield "vllm", VllmServer(args.peer_runner, peer_checkpoint, results_dir / f"server-vllm{suffix}.log",
                                 args.server_start_timeout)
    extra = args.serve_args.split()
    for name in names:
        flags = ["--model", model, *tandem_mode_flags(name), *extra]
        yield f"tandem {name}", ServerProcess(flags, results_dir / f"server-{name}{suffix}.log",
                                              args.server_start_timeout)


def _hf_checkpoint(model: str, tmp: Path) -> Path:
    """A Hugging Face checkpoint of `model` for a peer: the directory itself, or a GGUF file's conversion."""
    from engine.convert import convert_gguf
    from engine.model.gguf_checkpoint import is_gguf_file
    if not is_gguf_file(model):
        return Path(model)
    out = tmp / "hf-checkpoint"
    convert_gguf(model, out)
    return out


def _measure(name: str, server, args, rates, samples, warm) -> list[PeerRun]:
    """Start `server`, warm it with the whole workload once, run every rate; a server that cannot start or be
    reached gives one PeerRun with its error and no metrics."""
    print(f"[{name}] starting", flush=True)
    runs = []
    try:
        with server:
            for index, rate in enumerate(rates):
                config = ClientConfig(server.base_url, None, args.ignore_eos, args.max_concurrency, args.timeout,
                                      sys.stderr.isatty())
                gaps = arrival_gaps(len(samples[index]), rate, args.burstiness, args.seed)
                first = warm if index == 0 else []
                _, results, duration = asyncio.run(run_requests(config, samples[index], gaps, first))
                run = PeerRun(name, rate, compute_metrics(results, duration), results)
                print(f"[{name}] rate {rate:g}: {run.summary_line()}", flush=True)
                runs.append(run)
    except (ServerStartError, ServerUnreachable) as error:
        print(f"[{name}] {error}", file=sys.stderr, flush=True)
        runs.append(PeerRun(name, rates[0], None, [], error=str(error).splitlines()[0]))
    return runs


def _write_results(runs: list[PeerRun], args: argparse.Namespace, results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    command = "tandem bench peer " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "peer"] else ""
    markdown = format_markdown(runs, command)
    (results_dir / "results.md").write_text(markdown)
    rows = runs_json(runs, args.max_concurrency, args.burstiness)
    (results_dir / "results.json").write_text(json.dumps(rows, indent=2, default=str))
    plot = write_plot(runs, results_dir / "peer.png")
    print("\n" + markdown)
    print(f"results in {results_dir}/: results.md, results.json{', ' + plot.name if plot else ''}", flush=True)
