"""`tandem plan --calibrate`: the serving path's costs, measured on a real server at a light load.

For each kind of deployment the plan compares (colocated-(W/T) replicas of the plan's TP size T, and
disagg-1pDd with the plan's prefill and decode TP sizes for the disaggregated splits: what the TP groups'
messages and collectives cost the serving path is in what it measures), it starts `tandem serve` as
`tandem bench compare` starts that mode (cluster/bench/compare_server.py, compare_modes.py), sends two warm-ups,
and then, reading the CPU time of the server's process tree (the serve
process, Ray's daemons and workers: cluster/plan/process_cpu.py) and of this process (the benchmark client):

    idle       IDLE_S seconds with nothing sent                         -> baseline_cores = CPU / seconds (all of
                                                                           it: the serve process, Ray's daemons,
                                                                           the workers' idle loops, the client)
    runs A-C   LIGHT_RUNS: 64-token prompts at 2 req/s with many (A)    -> CPU of each run
               and with few (B) output tokens per request, and a burst
               of them sent at once (C: many tokens per step)

A run's CPU is the engines' steps and KV transfers (what the planner's simulation of the same requests, sent
at the same times, spends in them), the baseline, and the serving path's: `request_cpu_s` x requests +
`token_cpu_s` x tokens + `step_cpu_s` x steps (the simulation's). The three runs give the three costs
(non-negative least squares). Run A's latencies give the rest: `step_overhead_sigma` is the spread of the
time a step takes beyond the step model's that makes the simulated inter-token times spread as the measured
ones (at p90 and p99: what the serving path's threads, Ray's daemons and the machine add to some steps and
not others, which the step model, measured on a worker alone, lacks), `step_overhead_s` is what the measured
TPOT p50 has over the simulated one, then `request_overhead_s` what the measured TTFT p50 has over it. The
costs depend on each other a little (the fixed step time is worker CPU), so the fit is repeated FIT_ROUNDS
times.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cluster.bench.compare_modes import ModeSettings, serving_mode
from cluster.bench.compare_server import ServerProcess
from cluster.bench.serve_client import ClientConfig, run_requests
from cluster.bench.serve_metrics import Distribution, RequestResult
from cluster.bench.serve_workloads import RandomWorkload, arrival_gaps, generate_requests
from cluster.plan.deployment import Deployment
from cluster.plan.host_model import ServingCosts
from cluster.plan.process_cpu import ProcessCpu, cpu_between, snapshot
from cluster.plan.simulator import ServingShape, SimRequest, simulate, simulate_with_usage
from cluster.plan.step_model import StepTimeModel, nonnegative_least_squares

IDLE_S = 6.0  # Ray's daemons do their periodic work every few seconds
FIT_ROUNDS = 3
SIGMA_GRID = tuple(round(0.1 * k, 1) for k in range(31))  # the step_overhead_sigma values tried: 0 .. 3
VOCAB_SIZE = 256


@dataclass(frozen=True)
class LightRun:
    """`count` requests of `workload` at `rate` req/s (inf: all at once)."""

    workload: RandomWorkload
    rate: float
    count: int


LIGHT_RUNS = (LightRun(RandomWorkload(64, 32), 2.0, 30), LightRun(RandomWorkload(64, 2), 2.0, 30),
              LightRun(RandomWorkload(64, 32), math.inf, 16))


@dataclass(frozen=True)
class MeasuredRun:
    """One light run: the requests as sent (seconds from the first), what the client saw, the wall time between
    the CPU readings and the CPU the server's processes and the client used in it."""

    requests: tuple[SimRequest, ...]
    results: tuple[RequestResult, ...]
    seconds: float
    cpu_s: float
    cpu_by_process: tuple[tuple[str, float], ...] = ()  # ("client", s), ("serve", s), ("workers", s), ("ray", s)

    def describe(self) -> str:
        shares = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.cpu_by_process)
        return (f"{len(self.requests)} requests, {self.tokens} tokens in {self.seconds:.1f} s: CPU {self.cpu_s:.2f} s "
                f"({shares})")

    @property
    def tokens(self) -> int:
        return sum(request.output_len for request in self.requests)


def calibration_deployments(devices: int, prefill_tp: int = 1, decode_tp: int = 1,
                             replica_tp: int = 1) -> list[Deployment]:
    """One deployment per kind on `devices` devices: as many colocated replicas of replica_tp ranks as fit, and,
    when a decode worker fits beside one prefill worker, one prefill worker of prefill_tp ranks with as many decode
    workers of decode_tp ranks as fit (TP=1: colocated-W and disagg-1p(W-1)d)."""
    colocated = [Deployment(0, devices // replica_tp, 1, replica_tp)] if devices >= replica_tp else []
    decode = (devices - prefill_tp) // decode_tp
    return colocated + ([Deployment(1, decode, prefill_tp, decode_tp)] if decode >= 1 else [])


def calibrate(deployment: Deployment, settings: ModeSettings, model: StepTimeModel,
              shape: ServingShape) -> ServingCosts:
    """Serves the light runs on a real `deployment` and fits its serving costs (see the module docstring).
    RuntimeError when the server cannot be started or a request fails."""
    baseline, runs = measure(deployment, settings)
    return fit_costs(runs, baseline, deployment, model, shape)


def measure(deployment: Deployment, settings: ModeSettings) -> tuple[float, list[MeasuredRun]]:
    """(baseline cores, the light runs) on a `tandem serve` of `deployment`."""
    mode = serving_mode(deployment.name, settings)
    with tempfile.TemporaryDirectory(prefix="tandem-calibrate-") as tmp:
        print(f"calibrating {deployment.name}: tandem serve {' '.join(mode.serve_flags)}", file=sys.stderr)
        with ServerProcess(list(mode.serve_flags), Path(tmp) / "serve.log") as server:
            config = ClientConfig(server.base_url)
            warmups = generate_requests(LIGHT_RUNS[0].workload, 2, VOCAB_SIZE, seed=1)
            _send(config, warmups, [0.0] * len(warmups))
            time.sleep(1.0)
            before = CpuReading.now(server.pid)
            time.sleep(IDLE_S)
            after = CpuReading.now(server.pid)
            runs = [_measured_run(config, server.pid, run, index) for index, run in enumerate(LIGHT_RUNS)]
    idle_s, idle = after.wall_s - before.wall_s, cpu_by_kind(server.pid, before, after)
    baseline = sum(idle.values()) / idle_s
    shares = ", ".join(f"{name} {seconds / idle_s:.3f}" for name, seconds in idle.items())
    print(f"  idle: {baseline:.3f} cores ({shares})", file=sys.stderr)
    for name, run in zip("ABC", runs):
        print(f"  run {name}: {run.describe()}", file=sys.stderr)
    return baseline, runs


@dataclass(frozen=True)
class CpuReading:
    """The clocks at one moment: wall, this process's CPU (the client's) and the server tree's snapshot."""

    wall_s: float
    client_cpu_s: float
    tree: dict[int, ProcessCpu]

    @classmethod
    def now(cls, server_pid: int) -> "CpuReading":
        return cls(time.monotonic(), time.process_time(), snapshot(server_pid))


def cpu_by_kind(server_pid: int, before: CpuReading, after: CpuReading) -> dict[str, float]:
    """CPU seconds used between two readings, by kind of process: the client (this process), the serve
    process, the workers (Ray actors) and Ray's own processes (daemons, agents)."""
    used = {"client": after.client_cpu_s - before.client_cpu_s, "serve": 0.0, "workers": 0.0, "ray": 0.0}
    for process in cpu_between(before.tree, after.tree):
        kind = "serve" if process.pid == server_pid else "workers" if _is_worker(process.name) else "ray"
        used[kind] += process.cpu_s
    return used


def _measured_run(config: ClientConfig, server_pid: int, light: LightRun, index: int) -> MeasuredRun:
    samples = generate_requests(light.workload, light.count, VOCAB_SIZE, seed=100 + index)
    gaps = arrival_gaps(len(samples), light.rate, 1.0, seed=index)
    before = CpuReading.now(server_pid)
    results = _send(config, samples, gaps)
    after = CpuReading.now(server_pid)
    by_process = cpu_by_kind(server_pid, before, after)
    first = min(r.send_time for r in results)
    requests = tuple(SimRequest(r.send_time - first, r.prompt_len, r.output_tokens) for r in results)
    return MeasuredRun(requests, tuple(results), after.wall_s - before.wall_s, sum(by_process.values()),
                       tuple(by_process.items()))


def _is_worker(name: str) -> bool:
    """A Ray actor process of a worker (ray::PrefillActor, ray::DecodeActor: replicas are DecodeActors)."""
    return name.startswith("ray::") and "Actor" in name and "Agent" not in name


def _send(config: ClientConfig, samples, gaps: list[float]) -> list[RequestResult]:
    _, results, _ = asyncio.run(run_requests(config, samples, gaps, []))
    failed = [r for r in results if not r.success or not r.chunk_times]
    if failed:
        raise RuntimeError(f"calibration: {len(failed)} of {len(results)} requests failed ({failed[0].error})")
    return results


def fit_costs(runs: list[MeasuredRun], baseline_cores: float, deployment: Deployment, model: StepTimeModel,
              shape: ServingShape) -> ServingCosts:
    """The costs that make the simulation of `runs` spend their measured CPU and, for runs[0], give their
    measured TTFT and TPOT p50 (see the module docstring)."""
    costs = ServingCosts(baseline_cores=baseline_cores)
    for _ in range(FIT_ROUNDS):
        costs = _fit_cpu(runs, deployment, model, shape, costs)
        costs = _fit_step_spread(runs[0], deployment, model, shape, costs)
        costs = _fit_latency(runs[0], deployment, model, shape, costs)
    return costs


def _fit_cpu(runs: list[MeasuredRun], deployment: Deployment, model: StepTimeModel, shape: ServingShape,
             costs: ServingCosts) -> ServingCosts:
    counts, serving = [], []
    for run in runs:
        _, usage = simulate_with_usage(deployment, list(run.requests), model, replace(shape, costs=costs))
        counts.append((len(run.requests), run.tokens, usage.steps))
        serving.append(run.cpu_s - usage.jobs_cpu_s - costs.baseline_cores * run.seconds)
    request_cpu, token_cpu, step_cpu = nonnegative_least_squares(np.asarray(counts, dtype=float),
                                                                 np.asarray(serving))
    return replace(costs, request_cpu_s=float(request_cpu), token_cpu_s=float(token_cpu), step_cpu_s=float(step_cpu))


def _fit_step_spread(run: MeasuredRun, deployment: Deployment, model: StepTimeModel, shape: ServingShape,
                     costs: ServingCosts) -> ServingCosts:
    """The step_overhead_sigma of SIGMA_GRID whose simulated inter-token times are closest to the run's at p90
    and p99 (the squared log ratios summed); `costs` unchanged when the run has no inter-token times."""
    measured = itl_tail(run.results)
    if min(measured) <= 0:
        return costs

    def distance(sigma: float) -> float:
        spread = replace(shape, costs=replace(costs, step_overhead_sigma=sigma))
        simulated = itl_tail(_simulated_results(run, deployment, model, spread))
        return sum(math.log(max(s, 1e-9) / m) ** 2 for s, m in zip(simulated, measured))

    return replace(costs, step_overhead_sigma=min(SIGMA_GRID, key=distance))


def itl_tail(results) -> tuple[float, float]:
    """(p90, p99) of the gaps between the streamed chunks of every request, as `bench serve` reports its ITL
    (ms; 0, 0 without any)."""
    itl = Distribution.of_seconds([gap for result in results for gap in result.itls])
    return itl.p90, itl.p99


def _fit_latency(run: MeasuredRun, deployment: Deployment, model: StepTimeModel, shape: ServingShape,
                 costs: ServingCosts) -> ServingCosts:
    measured_ttft, measured_tpot = latency_medians(run.results)
    _, predicted_tpot = latency_medians(_simulated_results(run, deployment, model, replace(shape, costs=costs)))
    costs = replace(costs, step_overhead_s=max(0.0, costs.step_overhead_s + measured_tpot - predicted_tpot))
    predicted_ttft, _ = latency_medians(_simulated_results(run, deployment, model, replace(shape, costs=costs)))
    return replace(costs, request_overhead_s=max(0.0, costs.request_overhead_s + measured_ttft - predicted_ttft))


def _simulated_results(run: MeasuredRun, deployment: Deployment, model: StepTimeModel,
                       shape: ServingShape) -> list[RequestResult]:
    traces = simulate(deployment, list(run.requests), model, shape)
    return [RequestResult(True, t.request.prompt_len, t.request.arrival_s, t.token_times, (1,) * len(t.token_times))
            for t in traces]


def latency_medians(results) -> tuple[float, float]:
    """(TTFT p50, TPOT p50 of the requests with more than one token) in seconds."""
    tpots = [r.tpot for r in results if r.output_tokens > 1]
    return statistics.median(r.ttft for r in results), statistics.median(tpots) if tpots else 0.0
