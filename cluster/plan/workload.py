"""The workload the planner simulates: arrival times and prompt / output lengths of every request.

From flags: the same datasets and arrival process as `tandem bench serve` (cluster/bench/serve_workloads.py:
`random`, `mixed`, `prefix-repetition`; gamma-distributed gaps at --request-rate with --burstiness), drawn
with the same seed, so `tandem plan --seed S` simulates the very requests `tandem bench serve --seed S`
sends. From a result JSON (`tandem bench serve --result-json`, or `vllm bench serve`'s): its request rate
and burstiness, and its mean prompt and output lengths (or the per-request `input_lens` / `output_lens`
that a detailed vLLM result carries).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.bench.serve import workload_from_args
from cluster.bench.serve_workloads import RandomWorkload, add_shape_arguments, arrival_gaps, generate_requests
from cluster.plan.simulator import SimRequest

RESULT_KEYS = ("completed", "total_input_tokens", "total_output_tokens", "request_rate")
BENCH_VOCAB_SIZE = 256  # `tandem bench serve --vocab-size` default: the same draws, so the same lengths


@dataclass(frozen=True)
class PlanWorkload:
    """The requests to simulate and words for where they came from."""

    description: str
    request_rate: float
    requests: tuple[SimRequest, ...]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags, named and defaulting as `tandem bench serve`'s."""
    parser.add_argument("--request-rate", type=float, default=None,
                        help="req/s ('inf': all at once); required unless --workload-json gives it")
    parser.add_argument("--workload-json", default=None, metavar="FILE",
                        help="a `tandem bench serve --result-json` (or `vllm bench serve`) result: its rate, "
                             "burstiness and lengths replace the dataset flags (--request-rate still wins)")
    parser.add_argument("--dataset-name", choices=("random", "prefix-repetition", "mixed"), default="random",
                        help="as `bench serve`'s (the planner computes every prompt whole: no prefix cache hits)")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests simulated per deployment")
    parser.add_argument("--seed", type=int, default=0)
    add_shape_arguments(parser, "output length for every dataset but prefix-repetition (every output is this "
                                "long: the planner assumes no early EOS)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    parser.add_argument("--arrival-seed", type=int, default=None,
                        help="seed of the arrival gaps (default: --seed); `bench compare` draws the prompts of its "
                             "i-th rate with --seed + 1000 i and the gaps of every rate with --seed")


def workload_from_flags(args: argparse.Namespace) -> PlanWorkload:
    """The workload of --workload-json, or of the dataset flags. ValueError names the bad flag or file."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.workload_json is not None:
        return _from_result(Path(args.workload_json), args)
    if args.request_rate is None:
        raise ValueError("--request-rate is required (or --workload-json with a bench result that has one)")
    workload = workload_from_args(args)
    samples = generate_requests(workload, args.num_prompts, BENCH_VOCAB_SIZE, args.seed)
    lengths = [(len(s.prompt_token_ids), s.output_len) for s in samples]
    words = f"{args.dataset_name} {workload}"
    requests = _timed(lengths, args.request_rate, args.burstiness, _arrival_seed(args))
    return PlanWorkload(words, args.request_rate, requests)


def _arrival_seed(args: argparse.Namespace) -> int:
    return args.seed if args.arrival_seed is None else args.arrival_seed


def _timed(lengths: list[tuple[int, int]], rate: float, burstiness: float, seed: int) -> tuple[SimRequest, ...]:
    """Requests sent at the cumulative gaps `tandem bench serve` waits before each (same seed, same gaps)."""
    gaps = arrival_gaps(len(lengths), rate, burstiness, seed)
    times = itertools.accumulate(gaps)
    return tuple(SimRequest(t, prompt, output) for t, (prompt, output) in zip(times, lengths))


def _from_result(path: Path, args: argparse.Namespace) -> PlanWorkload:
    data = _read_result(path)
    completed = int(data["completed"])
    rate = args.request_rate if args.request_rate is not None else _rate(data["request_rate"], path)
    burstiness = float(data.get("burstiness") or 1.0)
    if isinstance(data.get("input_lens"), list) and isinstance(data.get("output_lens"), list):
        lengths = _recorded_lengths(data, path)
        words = f"{path.name}: {len(lengths)} recorded requests"
    else:
        mean_in = max(1, round(data["total_input_tokens"] / completed))
        mean_out = max(1, round(data["total_output_tokens"] / completed))
        samples = generate_requests(RandomWorkload(mean_in, mean_out), args.num_prompts, BENCH_VOCAB_SIZE,
                                    args.seed)
        lengths = [(len(s.prompt_token_ids), s.output_len) for s in samples]
        words = f"{path.name}: mean prompt {mean_in}, mean output {mean_out} tokens (the result has no lengths " \
                f"per request: every request gets the means)"
    return PlanWorkload(words, rate, _timed(lengths, rate, burstiness, _arrival_seed(args)))


def _read_result(path: Path) -> dict:
    """The JSON object at `path` if it is a bench serve result; ValueError saying what it is not."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"--workload-json {path}: cannot read it ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--workload-json {path}: not JSON ({error})") from None
    missing = [key for key in RESULT_KEYS if not isinstance(data, dict) or key not in data]
    if missing:
        raise ValueError(f"--workload-json {path}: not a `tandem bench serve` result (no {', '.join(missing)}); "
                         "write one with `tandem bench serve --result-json FILE`")
    numbers = [data[key] for key in RESULT_KEYS[:3]]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in numbers) or data["completed"] < 1:
        raise ValueError(f"--workload-json {path}: completed must be >= 1 and the token totals numbers >= 0")
    return data


def _rate(value, path: Path) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        rate = math.nan
    if not rate > 0:
        raise ValueError(f"--workload-json {path}: request_rate {value!r} is not a positive number or 'inf'")
    return rate


def _recorded_lengths(data: dict, path: Path) -> list[tuple[int, int]]:
    inputs, outputs = np.asarray(data["input_lens"]), np.asarray(data["output_lens"])
    if inputs.shape != outputs.shape or inputs.ndim != 1 or not len(inputs) \
            or not np.issubdtype(inputs.dtype, np.integer) or not np.issubdtype(outputs.dtype, np.integer) \
            or inputs.min() < 1 or outputs.min() < 1:
        raise ValueError(f"--workload-json {path}: input_lens and output_lens must be equally long lists of "
                         "positive integers")
    return [(int(a), int(b)) for a, b in zip(inputs, outputs)]
