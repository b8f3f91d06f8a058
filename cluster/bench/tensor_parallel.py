"""Benchmark: a tensor-parallel engine's step time against one rank's, on the same cores, side by side.

`tandem bench tp --shape llama-25m --tp 2 --threads 2`: three engines live in this process at once (the TP ones'
followers in their own processes): TP=1, TP=N with its CPU all-reduces through shared memory (the default),
and TP=N with every collective through gloo (`--no-gloo` leaves it out); rounds alternate between them, and in
each round each engine runs a decode phase
(--batch sequences of --context tokens, --steps timed decode steps) and a prefill step (one --prefill-tokens
prompt). TP=1 runs on --threads torch threads, each TP rank on --threads / N, so both use the same cores. Medians
over the rounds; the ratio TP / TP=1 is what is reported. On a CPU a TP step cannot be faster: the ranks share
the cores, and the all-reduces (two per layer, one for the embedding) and the logits gather are the extra cost.
Issue 29's bound: TP=2 costs at most 2x a TP=1 step; the last line says whether this run kept it. The KV
hand-off row: reading and writing back the full-head KV of one --prefill-tokens prompt's blocks, as a transfer
does (TP=1: its own pool; TP=N: gathered to and scattered from rank 0, engine/runner/group_kv.py), not a step.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-25m", help="seeded random checkpoint (cluster/bench/checkpoint.py)")
    parser.add_argument("--model", default=None, help="a checkpoint directory, GGUF file or 'tiny' instead of --shape")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size of the engine measured against TP=1")
    parser.add_argument("--threads", type=int, default=2, help="cores both engines use (TP ranks split them)")
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the timed prefill step")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians are reported)")
    parser.add_argument("--no-gloo", action="store_true", help="leave out the TP engine whose all-reduces use gloo")


def decode_ms(engine, batch: int, context: int, steps: int, tag: str) -> float:
    """Mean ms of one decode step over `steps` steps of `batch` sequences (prefilled first, untimed)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-d{i}", [(7 * i + j) % 200 + 3 for j in range(context)], params)
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in _live(engine, tag, batch)):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - started
    _drain(engine)
    return elapsed / steps * 1e3


def prefill_ms(engine, tokens: int, tag: str) -> float:
    """ms of the step that prefills one prompt of `tokens` tokens (the prefix cache missed: fresh tokens)."""
    from engine import SamplingParams

    engine.add_request(f"{tag}-p", [(13 * j + len(tag)) % 250 + 3 for j in range(tokens)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    _drain(engine)
    return elapsed * 1e3


def _live(engine, tag: str, batch: int) -> list:
    return [s for i in range(batch) if (s := engine.get_sequence(f"{tag}-d{i}")) is not None]


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure(engines: dict, args: argparse.Namespace) -> dict:
    """{label: (decode ms per round, prefill ms per round)}, rounds alternating between the engines."""
    import torch

    results = {label: ([], []) for label in engines}
    for round_index in range(args.rounds + 1):  # round 0 warms up (kernels built, pages touched), not kept
        for label, (llm, threads) in engines.items():
            torch.set_num_threads(threads)
            tag = f"r{round_index}-{label}"
            decode = decode_ms(llm.engine, args.batch, args.context, args.steps, tag)
            prefill = prefill_ms(llm.engine, args.prefill_tokens, tag)
            if round_index:
                results[label][0].append(decode)
                results[label][1].append(prefill)
    return results


def handoff_ms(engine, tokens: int) -> tuple[float, int]:
    """ms to gather and scatter back the full-head KV of `tokens` tokens' blocks, and its bytes: a single rank's
    own pool (index_select / index_copy), a group's through rank 0. The blocks' contents are left as they were."""
    import torch

    blocks = engine.reserve_blocks(-(-tokens // engine.config.block_size))
    try:
        leader, kv = engine.tp_leader, engine.kv_cache.kv
        ids = torch.tensor(blocks, dtype=torch.long)
        start = time.perf_counter()
        if leader is None:
            full = kv.index_select(2, ids)  # [L, 2, n, bs, H, D]
            kv.index_copy_(2, ids, full)
        else:
            full = leader.gather_kv_heads(blocks)
            leader.scatter_kv_heads(blocks, full)
        return (time.perf_counter() - start) * 1e3, full.numel() * full.element_size()
    finally:
        engine.free_blocks(blocks)


def measure_handoff(engines: dict, args: argparse.Namespace) -> dict:
    """{label: (ms per round, bytes)}: handoff_ms of a --prefill-tokens prompt, rounds alternating (one warm-up)."""
    import torch

    results = {label: ([], 0) for label in engines}
    for round_index in range(args.rounds + 1):
        for label, (llm, threads) in engines.items():
            torch.set_num_threads(threads)
            ms, nbytes = handoff_ms(llm.engine, args.prefill_tokens)
            if round_index:
                results[label] = (results[label][0] + [ms], nbytes)
    return results


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.bench.checkpoint import build_bench_checkpoint
    from engine import LLM

    if args.tp < 2 or args.threads < args.tp or args.rounds < 1:
        raise ValueError("--tp must be >= 2, --threads >= --tp, --rounds >= 1")
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(build_bench_checkpoint(Path(scratch) / args.shape, args.shape))
        options = dict(device="cpu", dtype="float32", max_num_seqs=max(8, args.batch + 1),
                       max_num_batched_tokens=max(2048, args.prefill_tokens), kv_cache_memory=256 << 20)
        torch.set_num_threads(args.threads)
        load_before = os.getloadavg()[0]
        with contextlib.ExitStack() as stack:
            engines = {"TP=1": (stack.enter_context(LLM(model, **options)), args.threads)}
            kinds = [("", "shared_memory")] + ([] if args.no_gloo else [(" gloo", "gloo")])
            for suffix, reduce in kinds:
                llm = stack.enter_context(LLM(model, tensor_parallel_size=args.tp, tp_cpu_all_reduce=reduce, **options))
                engines[f"TP={args.tp}{suffix}"] = (llm, args.threads // args.tp)
            results = measure(engines, args)
            handoff = measure_handoff(engines, args)
        torch.set_num_threads(args.threads)
    report(results, args, (load_before, os.getloadavg()[0]), handoff)
    return 0


def report(results: dict, args: argparse.Namespace, load: tuple[float, float], handoff: dict | None = None) -> None:
    """The table; load: the 1-minute load average before and after (the run itself adds ~2; above the core count
    before it, other processes shared the cores: a multi-threaded TP=1 step suffers most, the ratios flatter TP)."""
    median = statistics.median
    labels = list(results)
    print(f"{args.model or args.shape}, {args.threads} threads (TP ranks: {args.threads // args.tp} each), "
          f"median of {args.rounds} alternating rounds; ms per step, ratio to TP=1")
    print(f"{'step':<30}" + "".join(f"{label + ' ms':>14}" for label in labels) +
          "".join(f"{label + ' ratio':>16}" for label in labels[1:]))
    names = [f"decode ({args.batch} seqs, ctx {args.context})", f"prefill ({args.prefill_tokens} tokens)"]
    worst = {}
    for kind, name in enumerate(names):
        times = [median(results[label][kind]) for label in labels]
        ratios = [t / times[0] for t in times[1:]]
        for label, ratio in zip(labels[1:], ratios):
            worst[label] = max(worst.get(label, 0.0), ratio)
        print(f"{name:<30}" + "".join(f"{t:>14.2f}" for t in times) + "".join(f"{r:>15.2f}x" for r in ratios))
    if handoff:
        times = [median(handoff[label][0]) for label in labels]
        mib = handoff[labels[0]][1] / (1 << 20)
        print(f"{f'KV hand-off ({mib:.1f} MiB)':<30}" + "".join(f"{t:>14.2f}" for t in times)
              + "".join(f"{t / times[0]:>15.2f}x" for t in times[1:]) + "   (gather + scatter, not a step)")
    for label, ratio in worst.items():
        verdict = "within" if ratio <= 2.0 else "OVER"
        print(f"{label} costs at most {ratio:.2f}x a TP=1 step: {verdict} issue 29's bound of 2x")
    busy = " (busy before it started: other processes shared the cores)" if load[0] > (os.cpu_count() or 1) else ""
    print(f"load average before / after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores{busy}")
