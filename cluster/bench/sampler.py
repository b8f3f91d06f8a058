"""Benchmark: engine.sampling.sampler.Sampler alone, on random logits, per sampling mode.

`tandem bench sampler --rows 64 --vocab 151936 --device cpu`: for greedy, temperature 1, top_k 50,
top_p 0.9, top_k 50 + top_p 0.9, all-seeded temperature 1, min_p, logprobs and the penalties (each row
with a history of HISTORY_TOKENS tokens, half of them prompt), the median wall time of one call over
`--repeats` warm calls (after `--warmup` calls), tokens back on the host included (the call ends in its
one device-to-host sync, so no extra synchronisation is needed). Issue 10's target: 64 rows x 152k vocab
at temperature 1 under 50 ms on CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {},
    "top_k 50": {"top_k": 50},
    "top_p 0.9": {"top_p": 0.9},
    "top_k 50 + top_p 0.9": {"top_k": 50, "top_p": 0.9},
    "seeded temperature 1": {"seed": 1234},
    "min_p 0.05": {"min_p": 0.05},
    "greedy + logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "greedy + penalties": {"temperature": 0.0, "repetition_penalty": 1.2, "presence_penalty": 0.5,
                           "frequency_penalty": 0.5},
    "temperature 1 + penalties + logprobs 20": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "logprobs": 20},
}
HISTORY_TOKENS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=64, help="sampled rows per call")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen's by default)")
    parser.add_argument("--device", default="cpu", help="torch device of the logits: cpu, cuda, cuda:1, ...")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per mode (the median is shown)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per mode first")
    parser.add_argument("--seed", type=int, default=0, help="seed of the logits and of the sampler")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def time_mode(sampler, logits, params, repeats: int, warmup: int) -> float:
    """Median seconds of one sampler call over `repeats` calls, after `warmup` untimed ones."""
    rows, vocab = logits.shape
    histories = [([(r * 7919 + i * 104729) % vocab for i in range(HISTORY_TOKENS)], HISTORY_TOKENS // 2)
                 for r in range(rows)]
    times = []
    for call in range(warmup + repeats):
        positions = list(range(call * rows, (call + 1) * rows))  # new positions: fresh seeded draws
        started = time.perf_counter()
        tokens = sampler(logits, [params] * rows, positions, histories)
        elapsed = time.perf_counter() - started
        if call >= warmup:
            times.append(elapsed)
        assert len(tokens) == rows and all(0 <= t < logits.shape[1] for t in tokens)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.sampling.sampler import Sampler
    from engine.sampling_params import SamplingParams

    if args.rows < 1 or args.vocab < 1 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--rows, --vocab and --repeats must be positive, --warmup at least 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3).to(device)  # [rows, vocab]
    sampler = Sampler(args.seed)
    print(f"Sampler on {args.rows} rows x {args.vocab} vocab, {device}, torch threads "
          f"{torch.get_num_threads()}; median of {args.repeats} warm calls")
    print(f"{'mode':<40} {'ms/call':>9}")
    for name, fields in MODES.items():
        seconds = time_mode(sampler, logits, SamplingParams(**fields), args.repeats, args.warmup)
        print(f"{name:<40} {seconds * 1e3:>9.1f}")
    return 0
