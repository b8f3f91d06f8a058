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
hand-off row: moving the full-head KV of one --prefill-tokens prompt's blocks out and back in, as a transfer's
ends do (TP=1: index_select from and index_copy_ into its own pool; TP=N: GroupStaging.stage_out, every rank's heads
gathered into rank 0's staging blocks, and GroupStaging.land, scattered back from there: kv_transfer/group_pool.py,
engine/runner/group_kv.py), out + in ms (each also shown), not a step.
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


def handoff_ms(engine, tokens: int, staging=None) -> tuple[float, float, int]:
    """ms to move the full-head KV of `tokens` tokens' blocks out of the engine and ms to move it back in, as a
    transfer's two ends do, and its bytes. A single rank: index_select from its own pool, index_copy_ back. A group
    (staging: its GroupStaging): stage_out (every rank's heads gathered into staging blocks, the engine blocks
    freed), then land (other staging blocks, each paired with a reserved engine block, scattered to every rank).
    Every block is free again afterwards."""
    import torch

    from kv_transfer.results import ReceivedKV

    num_blocks = -(-tokens // engine.config.block_size)
    blocks = engine.reserve_blocks(num_blocks)
    if staging is None:
        try:
            kv, ids = engine.kv_cache.kv, torch.tensor(blocks, dtype=torch.long)
            start = time.perf_counter()
            full = kv.index_select(2, ids)  # [L, 2, n, bs, H, D]
            middle = time.perf_counter()
            kv.index_copy_(2, ids, full)
            return (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3, full.numel() * full.element_size()
        finally:
            engine.free_blocks(blocks)
    start = time.perf_counter()
    staged = staging.stage_out(blocks)  # frees the engine blocks
    out_ms = (time.perf_counter() - start) * 1e3
    try:
        landing = staging.receiver_view().allocate(num_blocks)  # paired with reserved engine blocks
        start = time.perf_counter()
        landed = staging.land(ReceivedKV(None, tuple(landing), 0, 0.0))
        in_ms = (time.perf_counter() - start) * 1e3
        engine.free_blocks(list(landed.block_ids))
    finally:
        staging.free(staged)
    return out_ms, in_ms, len(staged) * staging.kv[:, :, 0].numel() * staging.kv.element_size()


def measure_handoff(engines: dict, args: argparse.Namespace) -> dict:
    """{label: (out ms per round, in ms per round, bytes)}: handoff_ms of a --prefill-tokens prompt, rounds
    alternating (one warm-up); each group through a staging pool of twice the prompt's blocks. Every round moves
    the same engine blocks (all the others are held meanwhile), so what is timed is the copies and collectives, not
    the first writes to pages of the pool that no round touched before (the pools are allocated untouched)."""
    import torch

    from kv_transfer.group_pool import GroupStaging

    results, stagings, held = {label: ([], [], 0) for label in engines}, {}, {}
    for label, (llm, _) in engines.items():
        num_blocks = -(-args.prefill_tokens // llm.engine.config.block_size)
        held[label] = llm.engine.reserve_blocks(llm.engine.num_free_blocks - num_blocks)
        if llm.engine.tp_leader is not None:
            stagings[label] = GroupStaging(llm.engine, 2 * num_blocks)
    try:
        for round_index in range(args.rounds + 1):
            for label, (llm, threads) in engines.items():
                torch.set_num_threads(threads)
                out_ms, in_ms, nbytes = handoff_ms(llm.engine, args.prefill_tokens, stagings.get(label))
                if round_index:
                    results[label] = (results[label][0] + [out_ms], results[label][1] + [in_ms], nbytes)
    finally:
        for label, (llm, _) in engines.items():
            llm.engine.free_blocks(held[label])
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
        totals = [median(o + i for o, i in zip(*handoff[label][:2])) for label in labels]
        split = ", ".join(f"{label} {median(handoff[label][0]):.2f} + {median(handoff[label][1]):.2f}"
                          for label in labels)
        mib = handoff[labels[0]][2] / (1 << 20)
        print(f"{f'KV hand-off ({mib:.1f} MiB)':<30}" + "".join(f"{t:>14.2f}" for t in totals)
              + "".join(f"{t / totals[0]:>15.2f}x" for t in totals[1:])
              + f"   (out + in, not a step: {split})")
    for label, ratio in worst.items():
        verdict = "within" if ratio <= 2.0 else "OVER"
        print(f"{label} costs at most {ratio:.2f}x a TP=1 step: {verdict} issue 29's bound of 2x")
    busy = " (busy before it started: other processes shared the cores)" if load[0] > (os.cpu_count() or 1) else ""
    print(f"load average before / after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores{busy}")
