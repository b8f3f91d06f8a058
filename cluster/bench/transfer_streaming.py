"""`tandem bench transfer --streaming`: how much of the KV transfer layer-wise streaming hides, measured.

One prefill and one decode worker on a local Ray (separate processes, one CPU thread each unless told),
a seeded random checkpoint (cluster/bench/checkpoint.py), the same prompts sent one at a time under
`--kv-streaming request` and then `layer`, each cluster warmed by the whole workload once with other token
ids. Per prompt length it reports, from each request's Timing: the whole transfer (first byte -> ack),
the exposed part (prefill step end -> KV landed) and TTFT, side by side, and the fraction of
the whole-request transfer that layer streaming hides: 1 - exposed(layer) / transfer(request).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from cluster.backend import GenerationRequest, Timing
from cluster.bench.checkpoint import SHAPES, build_bench_checkpoint
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

MODES = ("request", "layer")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    prompt_tokens: int
    transfer_ms: float          # medians over the measured requests
    transfer_exposed_ms: float
    prefill_ms: float
    ttft_ms: float
    kv_bytes: int


def add_streaming_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--streaming: layer-wise KV streaming on real workers")
    group.add_argument("--streaming", action="store_true",
                       help="measure the exposed KV transfer with --kv-streaming request vs layer (local Ray)")
    group.add_argument("--shape", default="llama-25m", choices=sorted(SHAPES), help="the random checkpoint")
    group.add_argument("--prompt-lens", default="1024,2048", help="comma-separated prompt lengths in tokens")
    group.add_argument("--cpu-threads", type=int, default=1, help="torch threads per worker (CPU)")


def run_streaming(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    if not lengths or min(lengths) < 1 or args.repeats < 1:
        raise ValueError("--prompt-lens needs positive lengths and --repeats must be >= 1")
    if args.transport not in ("gloo", "grpc"):
        raise ValueError("--streaming measures gloo or grpc (nccl needs GPUs; ipc sends whole requests)")
    with tempfile.TemporaryDirectory(prefix="tandem-stream-") as tmp:
        model = build_bench_checkpoint(Path(tmp) / args.shape, args.shape)
        vocab = SHAPES[args.shape]["vocab_size"]
        results = [row for mode in MODES for row in _measure_mode(args, str(model), vocab, lengths, mode)]
    _print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def _measure_mode(args, model: str, vocab: int, lengths: list[int], mode: str) -> list[ModeResult]:
    from cluster.coordinator.start import start_cluster
    from cluster.workers.cluster_config import ClusterConfig

    config = ClusterConfig(model=model, transport=args.transport, kv_streaming=mode,
                           cpu_threads_per_worker=args.cpu_threads,
                           engine=EngineConfig(kv_cache_memory=256 << 20, max_num_batched_tokens=max(lengths)))
    coordinator = start_cluster(config)
    try:
        return asyncio.run(_drive(coordinator, vocab, lengths, args.repeats, mode))
    finally:
        asyncio.run(coordinator.shutdown())


async def _drive(backend, vocab: int, lengths: list[int], repeats: int, mode: str) -> list[ModeResult]:
    """Warm-up: the whole workload once with other token ids (no prefix-cache hits later); then each
    prompt alone, so nothing queues and the timing is the transfer's own."""
    warm, measured = _prompts(lengths, repeats, vocab, seed=1), _prompts(lengths, repeats, vocab, seed=2)
    for prompt in warm:
        await _one(backend, prompt)
    timings: dict[int, list[Timing]] = {n: [] for n in lengths}
    for prompt in tqdm(measured, desc=f"kv streaming {mode}", unit="req"):
        timings[len(prompt)].append(await _one(backend, prompt))
    return [_summary(mode, n, ts) for n, ts in timings.items()]


def _prompts(lengths: list[int], repeats: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(n)) for n in lengths for _ in range(repeats)]


async def _one(backend, prompt: tuple[int, ...]) -> Timing:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(f"stream-{time.monotonic_ns()}", prompt, params, time.perf_counter())
    timing = None
    async for chunk in backend.generate(request):
        timing = chunk.timing or timing
    if timing is None or timing.kv_bytes == 0:
        raise RuntimeError(f"a request came back without a KV transfer in its timing: {timing}")
    return timing


def _summary(mode: str, prompt_tokens: int, timings: list[Timing]) -> ModeResult:
    def median(field: str) -> float:
        return statistics.median(getattr(t, field) for t in timings)
    return ModeResult(mode, prompt_tokens, median("transfer_ms"), median("transfer_exposed_ms"),
                      median("prefill_ms"), median("ttft_ms"), timings[0].kv_bytes)


def _print_table(results: list[ModeResult], args: argparse.Namespace) -> None:
    by_key = {(r.mode, r.prompt_tokens): r for r in results}
    print(f"\nKV transfer, {args.transport}, {args.shape}, medians of {args.repeats} requests per length "
          f"(one at a time), ms")
    print(f"{'prompt':>7} {'KV MiB':>7} | {'request: xfer':>13} {'exposed':>8} {'TTFT':>8} | "
          f"{'layer: xfer':>11} {'exposed':>8} {'TTFT':>8} | {'hidden':>7} {'TTFT ratio':>10}")
    for n in sorted({r.prompt_tokens for r in results}):
        whole, streamed = by_key[("request", n)], by_key[("layer", n)]
        hidden = 1 - streamed.transfer_exposed_ms / whole.transfer_ms if whole.transfer_ms > 0 else 0.0
        print(f"{n:>7} {whole.kv_bytes / 2**20:>7.1f} | {whole.transfer_ms:>13.2f} {whole.transfer_exposed_ms:>8.2f} "
              f"{whole.ttft_ms:>8.1f} | {streamed.transfer_ms:>11.2f} {streamed.transfer_exposed_ms:>8.2f} "
              f"{streamed.ttft_ms:>8.1f} | {hidden:>6.0%} {streamed.ttft_ms / whole.ttft_ms:>10.2f}")
    print("hidden = 1 - exposed(layer) / transfer(request); exposed = prompt's prefill step end -> KV landed")
