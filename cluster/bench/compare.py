"""`tandem bench compare`: the same workload against each serving mode in turn, side by side.

    tandem bench compare --workers 2   # 48 mixed requests (20% of 1536 tokens, the rest 64) x rates 4, 8:
                                       # colocated-2 vs disagg-1p1d on the same 2 workers' worth of hardware
    tandem bench compare --gpus 4 --prefill-tp 2 --tp 2   # colocated-2-tp2 vs disagg-1p2d-ptp2: 4 GPUs each

For each mode (cluster/bench/compare_modes.py) it starts `tandem serve` as a subprocess, sends the
warm-up requests, runs the workload once per request rate through the streaming HTTP API (the
`tandem bench serve` client and metrics), checks that the server's KV pool is whole again, and stops
the server; `--repeats N` does all of that N times, every mode once per round. Then it writes into
--results-dir: results.md (one row per mode, rate and round with the hardware it got, the ratios and the
goal check, on the median of the rounds), results.json, ttft_cdf.png, itl_cdf.png, ttft_breakdown.png (the
first round's), and one server log per mode and round.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from cluster.bench.checkpoint import SHAPES, build_bench_checkpoint
from cluster.bench.compare_modes import ModeSettings, default_mode_names, default_workers, parse_modes, serving_mode
from cluster.bench.compare_plots import require_matplotlib, write_plots
from cluster.bench.compare_report import ModeRun, format_markdown, runs_json
from cluster.bench.compare_server import ServerProcess, ServerStartError
from cluster.bench.serve import add_workload_arguments, check_counts, workload_from_args
from cluster.bench.serve_client import ClientConfig, ServerUnreachable, run_requests
from cluster.bench.serve_metrics import compute_metrics, parse_goodput
from cluster.bench.serve_multiturn import run_conversations
from cluster.bench.serve_workloads import (Conversation, MultiturnWorkload, arrival_gaps, generate_conversations,
                                           generate_requests)

POOL_DRAIN_TIMEOUT_S = 20.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: embedded model)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="build a seeded random checkpoint of this shape instead (needs transformers)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "grpc"])
    parser.add_argument("--workers", "--gpus", type=int, default=None, dest="workers",
                        help="equal hardware: compare colocated-(G/T) replicas with the disagg splits that use all "
                             "G devices (TP=1: 2: disagg-1p1d; 4: 1p3d, 2p2d, 3p1d); each rank gets cores/G "
                             "threads or a GPU (default: 4 with 4 GPUs or 8 cores, else 2)")
    parser.add_argument("--prefill-tp", type=int, default=None,
                        help="with --gpus/--workers: ranks (GPUs) of each prefill worker (default 1)")
    parser.add_argument("--decode-tp", type=int, default=None,
                        help="with --gpus/--workers: ranks (GPUs) of each decode worker (default 1)")
    parser.add_argument("--tp", type=int, default=None,
                        help="with --gpus/--workers: ranks (GPUs) of each colocated replica (default 1)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated, instead of --workers' set: colocated-<N>[-tp<T>], "
                             "disagg-<P>p<D>d[-ptp<A>][-dtp<B>], disagg-<P>p<D>d-local<N>, colocated / "
                             "colocated-chunked (one in-process engine)")
    parser.add_argument("--request-rates", default="4,8", help="comma-separated req/s, 'inf' = all at once")
    parser.add_argument("--chunk-size", type=int, default=256, help="prefill chunk of colocated-chunked")
    parser.add_argument("--long-prefill-threshold", type=int, default=256,
                        help="disaggregated modes: max tokens of one prompt per step (0: off)")
    parser.add_argument("--kv-cache-memory-mib", type=int, default=None, help="KV pool per engine (MiB)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: every mode runs once per round, rounds one after another; ratios pair the "
                             "runs of a round and the goal is judged on their median (default 1)")
    parser.add_argument("--results-dir", default="bench_results/compare")
    parser.add_argument("--server-start-timeout", type=float, default=300.0)
    add_workload_arguments(parser)
    # the interference case: long prompts arriving while many requests decode, every output full length
    parser.set_defaults(dataset_name="mixed", num_prompts=48, num_warmups=2, mixed_long_fraction=0.2,
                        mixed_long_len=1536, mixed_short_len=64, random_output_len=128, ignore_eos=True)


def parse_rates(text: str) -> list[float]:
    """'2,4,inf' -> [2.0, 4.0, inf]; ValueError on anything not a positive number."""
    rates = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates: {part!r} is not a number") from None
        if not rate > 0:
            raise ValueError(f"--request-rates: {part!r} must be positive")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rates needs at least one rate")
    return rates


def _num_gpus(device: str) -> int:
    import torch
    return torch.cuda.device_count() if device in ("auto", "cuda") else 0


def _mode_names(args: argparse.Namespace, num_gpus: int) -> list[str]:
    """--modes, or the equal-hardware set of --gpus/--workers devices at the TP sizes given. ValueError names
    the flag (a TP size below 1 or not dividing the devices: cluster/plan/deployment.check_tp_sizes)."""
    sizes = {"--prefill-tp": args.prefill_tp, "--decode-tp": args.decode_tp, "--tp": args.tp}
    if args.modes is not None:
        if args.workers is not None:
            raise ValueError("give --workers (its equal-hardware set of modes) or --modes, not both")
        given = [flag for flag, size in sizes.items() if size is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: with --modes the TP sizes go in the mode names "
                             "(colocated-2-tp2, disagg-1p2d-ptp2, disagg-1p1d-ptp2-dtp2)")
        return parse_modes(args.modes)
    import os
    devices = args.workers or default_workers(num_gpus, os.cpu_count() or 1)
    return default_mode_names(devices, *(1 if size is None else size for size in sizes.values()))


def run(args: argparse.Namespace) -> int:
    """Runs every mode; 0 when every mode ran (failed requests are counted, not fatal), 1 when a server
    could not be started or reached. ValueError (exit 2 from the CLI) on invalid flags."""
    check_counts(args)
    require_matplotlib()
    num_gpus = _num_gpus(args.device)
    rates, names, slos = parse_rates(args.request_rates), _mode_names(args, num_gpus), parse_goodput(args.goodput)
    if args.chunk_size < 1 or args.long_prefill_threshold < 0 or args.repeats < 1:
        raise ValueError("--chunk-size and --repeats must be >= 1 and --long-prefill-threshold >= 0")
    if args.model is not None and args.shape is not None:
        raise ValueError("give --model or --shape, not both")
    workload = workload_from_args(args)
    # each rate gets its own prompts (one server serves every rate: repeating them would hit its prefix
    # cache); every mode gets the same prompts (multiturn: the same conversations) at the same rate
    make = generate_conversations if isinstance(workload, MultiturnWorkload) else generate_requests
    samples = [make(workload, args.num_prompts, args.vocab_size, args.seed + 1000 * index)
               for index in range(len(rates))]
    warmups = generate_requests(workload, args.num_warmups, args.vocab_size, args.seed + 1)
    longest = max([item.max_tokens if isinstance(item, Conversation) else len(item.prompt_token_ids) + item.output_len
                   for item in sum(samples, warmups)])
    results_dir = Path(args.results_dir)
    with tempfile.TemporaryDirectory(prefix="tandem-compare-") as tmp:
        model = args.model
        if args.shape is not None:
            model = str(build_bench_checkpoint(Path(tmp), args.shape, args.seed))
        settings = ModeSettings(model, args.dtype, args.device, args.transport, _round_up(longest, 16),
                                args.chunk_size, args.kv_cache_memory_mib, args.long_prefill_threshold,
                                num_gpus=num_gpus)
        modes = [serving_mode(name, settings) for name in names]  # ValueError before anything starts
        unit = "conversations" if isinstance(workload, MultiturnWorkload) else "requests"
        print(f"bench compare: {args.num_prompts} {args.dataset_name} {unit} x rates {args.request_rates} x "
              f"modes {', '.join(f'{m.name} ({m.hardware})' for m in modes)}; "
              f"model {args.model or args.shape or 'embedded default'}", flush=True)
        try:
            runs = [run for repeat in range(args.repeats) for mode in modes
                    for run in _run_mode(mode, args, rates, samples, warmups, slos, results_dir, repeat)]
        except (ServerStartError, ServerUnreachable) as error:
            print(f"tandem bench compare: {error}", file=sys.stderr)
            return 1
    _write_results(runs, args, results_dir)
    return 0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _run_mode(mode, args, rates, samples, warmups, slos, results_dir: Path, repeat: int = 0) -> list[ModeRun]:
    """One server for `mode` (round `repeat`): warm-ups, then one measured run per rate (samples[i] at
    rates[i]), each followed by the pool check."""
    log_path = results_dir / (f"server-{mode.name}.log" if repeat == 0 else f"server-{mode.name}-{repeat + 1}.log")
    tag = mode.name if args.repeats == 1 else f"{mode.name} #{repeat + 1}"
    print(f"[{tag}] starting tandem serve {' '.join(mode.serve_flags)}", flush=True)
    runs = []
    with ServerProcess(list(mode.serve_flags), log_path, args.server_start_timeout) as server:
        for index, rate in enumerate(rates):
            config = ClientConfig(server.base_url, None, args.ignore_eos, args.max_concurrency, args.timeout,
                                  sys.stderr.isatty())
            gaps = arrival_gaps(len(samples[index]), rate, args.burstiness, args.seed)
            batch, first = samples[index], warmups if index == 0 else []
            chats = bool(batch) and isinstance(batch[0], Conversation)
            run = run_conversations(config, batch, gaps, first) if chats else run_requests(config, batch, gaps, first)
            _, results, duration = asyncio.run(run)
            pool_whole = _wait_for_whole_pool(server)
            run = ModeRun(mode.name, rate, compute_metrics(results, duration, slos), results, pool_whole,
                          mode.hardware, repeat, mode.devices)
            print(f"[{tag}] rate {rate:g}: {run.summary_line()}", flush=True)
            runs.append(run)
    return runs


def _wait_for_whole_pool(server: ServerProcess) -> bool | None:
    """Polls /metrics until free == total KV blocks (bounded); None if the server does not report them."""
    deadline = time.monotonic() + POOL_DRAIN_TIMEOUT_S
    while True:
        text = server.metrics_text()
        free, total = _gauge(text, "tandem_kv_free_blocks"), _gauge(text, "tandem_kv_total_blocks")
        if free is None or total is None:
            return None
        if free == total or time.monotonic() > deadline:
            return free == total
        time.sleep(0.1)


def _gauge(metrics_text: str, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _write_results(runs: list[ModeRun], args: argparse.Namespace, results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    command = "tandem bench compare " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "compare"] else ""
    markdown = format_markdown(runs, command)
    (results_dir / "results.md").write_text(markdown)
    (results_dir / "results.json").write_text(json.dumps(runs_json(runs, vars(args)), indent=2, default=str))
    plots = write_plots([run for run in runs if run.repeat == 0], results_dir)  # the first round's
    print("\n" + markdown)
    print(f"results in {results_dir}/: results.md, results.json, " + ", ".join(p.name for p in plots), flush=True)
