"""`tandem bench engine --profile-steps`: what one step of each kind launches and where its time goes.

For a packed prefill (8 x 256 tokens), decode steps at batch 1 and 32 (128-token contexts) and a mixed step (32
decodes beside one 512-token chunk), torch.profiler records the steps and this prints, per step: on CUDA the
kernels the device ran (CUDA-graph replays included) and their device time, with the heaviest kernels by name,
and the CUDA runtime calls the host made (launches, copies, syncs); on CPU the aten operators and their self time.
Beside them, the host's side: the wall time per step (unprofiled) and, from a pass under cProfile, the Python
functions that took the most time of their own (a host-bound step names what its host time is spent on: the H200
run of session 31 found a mixed step issuing for 11 ms over 2.3 ms of kernels). It is the measurement behind
"where does a step's time go" on a GPU host, taken in one call by `make gpu-check`.
"""
from __future__ import annotations

import cProfile
import pstats
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch.autograd import DeviceType

from cluster.bench.limits import fresh_prompts

PREFILL, DECODE_SMALL, DECODE_LARGE, MIXED_DECODES, MIXED_CHUNK = (8, 256), 1, 32, 32, 512
CONTEXT, DECODE_STEPS = 128, 8
RUNTIME_CALLS = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent")


@dataclass(frozen=True)
class StepProfile:
    """One phase's steps as the profiler saw them, per step: `kernels` are CUDA kernels (on CPU: aten operators),
    `busy_ms` their summed time (device time on CUDA, self CPU time on CPU), `top` the heaviest by name (name,
    count per step, ms per step) and `runtime` the CUDA runtime calls per step (empty on CPU)."""

    phase: str
    steps: int
    kernels: float
    busy_ms: float
    top: tuple[tuple[str, float, float], ...]
    runtime: dict[str, float] = field(default_factory=dict)
    wall_ms: float | None = None   # the host's wall time per step, unprofiled
    python: tuple[tuple[str, float, float], ...] = ()  # cProfile: (function, calls per step, own ms per step)


def profile_steps(llm, top: int = 8) -> list[StepProfile]:
    """Profiles each phase of the module docstring on `llm`'s engine, aborting what it added after each (the
    engine is left with nothing running). Prints and returns the profiles."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    phases = [("prefill %d x %d" % PREFILL, lambda: _prefill(engine, vocab)),
              (f"decode b={DECODE_SMALL}", lambda: _decode(engine, vocab, DECODE_SMALL)),
              (f"decode b={DECODE_LARGE}", lambda: _decode(engine, vocab, DECODE_LARGE)),
              (f"mixed {MIXED_DECODES}d + {MIXED_CHUNK}", lambda: _mixed(engine, vocab))]
    profiles = []
    for name, setup in phases:
        wall_ms = _run_fresh(engine, setup, _wall_ms)  # first unprofiled: nothing profiled below is a first call
        profile = _run_fresh(engine, setup, lambda run: _profile(name, run, engine.device, top))
        python = _run_fresh(engine, setup, lambda run: _python_hotspots(run, top))
        profiles.append(replace(profile, wall_ms=wall_ms, python=python))
    _print(profiles)
    return profiles


def _run_fresh(engine, setup, measure):
    """measure(run_steps) over a fresh set-up of the phase, its requests aborted and drained afterwards."""
    run_steps, ids = setup()
    try:
        return measure(run_steps)
    finally:
        _drain(engine, ids)


def _wall_ms(run_steps) -> float:
    started = time.perf_counter()
    steps = run_steps()
    return (time.perf_counter() - started) * 1e3 / steps


def _python_hotspots(run_steps, top: int) -> tuple[tuple[str, float, float], ...]:
    """The `top` functions by their own time (cProfile's tottime) over the steps: (where, calls and ms per step)."""
    profiler = cProfile.Profile()
    steps = profiler.runcall(run_steps)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, ...)}
    heaviest = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return tuple((_where(key), row[1] / steps, row[2] * 1e3 / steps) for key, row in heaviest)


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    return name if path == "~" else f"{'/'.join(path.split('/')[-2:])}:{line} {name}"  # "~": a C function


def _drain(engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def _add(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[str]:
    from engine import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"profile-{tag}-{random.getrandbits(32):08x}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    return ids


def _prefill(engine, vocab: int):
    ids = _add(engine, fresh_prompts(*PREFILL, vocab), 1, "prefill")

    def run() -> int:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps
    return run, ids


def _decode(engine, vocab: int, batch: int):
    ids = _add(engine, fresh_prompts(batch, CONTEXT, vocab), 4 * DECODE_STEPS + 4, f"decode{batch}")
    _until_decoding(engine, batch)
    return lambda: _steps(engine, DECODE_STEPS), ids


def _mixed(engine, vocab: int):
    ids = _add(engine, fresh_prompts(MIXED_DECODES, CONTEXT, vocab), 64, "mixed")
    _until_decoding(engine, MIXED_DECODES)

    def run() -> int:  # the chunk's request joins the ids the caller aborts
        ids.extend(_add(engine, fresh_prompts(1, MIXED_CHUNK, vocab), 2, "chunk"))
        return _steps(engine, 1)
    return run, ids


def _until_decoding(engine, batch: int) -> None:
    """Steps until a step decodes `batch` sequences and prefills nothing."""
    stats = engine.stats
    for _ in range(64):
        prefilled, decoded = stats.num_prefill_tokens, stats.num_decode_tokens
        engine.step()
        if stats.num_prefill_tokens == prefilled and stats.num_decode_tokens - decoded == batch:
            return
    raise RuntimeError(f"no step decoded all {batch} sequences at once (max_num_seqs too small?)")


def _steps(engine, count: int) -> int:
    for _ in range(count):
        engine.step()
    return count


def _profile(name: str, run_steps, device: torch.device, top: int) -> StepProfile:
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        steps = run_steps()
        if cuda:
            torch.cuda.synchronize(device)
    counts, micros, runtime = Counter(), defaultdict(float), Counter()
    for event in prof.events():
        if event.name in RUNTIME_CALLS:
            runtime[event.name] += 1
        if (event.device_type == DeviceType.CUDA) == cuda and (cuda or event.name.startswith("aten::")):
            counts[event.name] += 1
            micros[event.name] += event.time_range.elapsed_us() if cuda else event.self_cpu_time_total
    heaviest = sorted(micros, key=micros.get, reverse=True)[:top]
    return StepProfile(name, steps, sum(counts.values()) / steps, sum(micros.values()) / steps / 1e3,
                       tuple((n, counts[n] / steps, micros[n] / steps / 1e3) for n in heaviest),
                       {n: c / steps for n, c in runtime.items()})


def _print(profiles: list[StepProfile]) -> None:
    for p in profiles:
        calls = ", ".join(f"{n} {c:g}" for n, c in sorted(p.runtime.items()))
        what = "kernels" if p.runtime else "operators"
        print(f"\n{p.phase}: {p.steps} step(s); per step {p.kernels:g} {what}, {p.busy_ms:.3f} ms busy"
              + (f"; runtime calls: {calls}" if calls else ""))
        for name, count, ms in p.top:
            print(f"  {ms:8.3f} ms  {count:6g}x  {name[:90]}")
        if p.wall_ms is not None:
            print(f"  host: {p.wall_ms:.3f} ms wall per step; own time of the heaviest Python functions (cProfile):")
        for name, count, ms in p.python:
            print(f"  {ms:8.3f} ms  {count:6g}x  {name[:90]}")
