"""`tandem bench transfer --streaming`: how much of the KV transfer layer-wise streaming hides, measured.

A `tandem serve` with one prefill and one decode worker on a local Ray (one CPU thread each unless told),
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
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from tqdm import tqdm

from cluster.bench.checkpoint import SHAPES, build_bench_checkpoint
from cluster.bench.compare_server import ServerProcess
from cluster.bench.serve_client import served_model

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
    """One `tandem serve` (1 prefill + 1 decode worker on a local Ray) with --kv-streaming mode."""
    flags = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--model", model,
             "--transport", args.transport, "--kv-streaming", mode, "--cpu-threads", str(args.cpu_threads),
             "--max-num-batched-tokens", str(max(lengths)), "--kv-cache-memory-mib", "256"]
    with tempfile.TemporaryDirectory(prefix="tandem-stream-log-") as logs:
        with ServerProcess(flags, Path(logs) / f"serve-{mode}.log", start_timeout_s=args.timeout_s) as server:
            return asyncio.run(_drive(server.base_url, vocab, lengths, args.repeats, mode))


async def _drive(base_url: str, vocab: int, lengths: list[int], repeats: int, mode: str) -> list[ModeResult]:
    """Warm-up: the whole workload once with other token ids (no prefix-cache hits later); then each
    prompt alone, so nothing queues and the timing is the transfer's own."""
    warm, measured = _prompts(lengths, repeats, vocab, seed=1), _prompts(lengths, repeats, vocab, seed=2)
    async with aiohttp.ClientSession() as session:
        model = await served_model(session, base_url)
        for prompt in warm:
            await _one(session, base_url, model, prompt)
        timings: dict[int, list[dict]] = {n: [] for n in lengths}
        for prompt in tqdm(measured, desc=f"kv streaming {mode}", unit="req"):
            timings[len(prompt)].append(await _one(session, base_url, model, prompt))
    return [_summary(mode, n, ts) for n, ts in timings.items()]


def _prompts(lengths: list[int], repeats: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths for _ in range(repeats)]


async def _one(session, base_url: str, model: str, prompt: list[int]) -> dict:
    """One completion of two greedy tokens; its tandem_timing."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        answer = await response.json()
    timing = answer.get("tandem_timing") if response.status == 200 else None
    if not timing or not timing.get("kv_bytes"):
        raise RuntimeError(f"a request came back without a KV transfer: HTTP {response.status} {answer}")
    return timing


def _summary(mode: str, prompt_tokens: int, timings: list[dict]) -> ModeResult:
    def median(field: str) -> float:
        return statistics.median(t[field] for t in timings)
    return ModeResult(mode, prompt_tokens, median("transfer_ms"), median("transfer_exposed_ms"),
                      median("prefill_ms"), median("ttft_ms"), timings[0]["kv_bytes"])


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
