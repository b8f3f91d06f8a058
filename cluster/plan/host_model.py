"""HostModel and CoreSharing: the host's cores shared between the workers' step threads, the KV transfers and
the serving path, and how that slows each of them.

Processor sharing, as the kernel's scheduler runs threads that all want the CPU: at any moment every runnable
thread gets an equal share of the host's cores, at most one core each,

    share = min(1, (cores - baseline_cores) / runnable threads)

and a piece of work that takes T seconds on a core of its own progresses at `share` seconds per second. The
runnable threads are:

    a worker in a step        `worker_threads` (its torch threads; the profile measured its steps with them)
    a KV transfer's copy      `transfer_threads` while its bytes move (a sender and a receiver thread:
                              the idle transfer measurement gave each a core of its own); its fixed cost
                              per transfer (round trips) is a wait that takes no core
    the serving path          1 while it has CPU work queued: `request_cpu_s` for every request that
                              arrives, `token_cpu_s` for every token a worker emits and `step_cpu_s` for
                              every worker step (the front end, the coordinator, the decode channels, the
                              client: measured by `tandem plan --calibrate` as CPU time of those processes)

`baseline_cores` is what the serving processes use while nothing is served (Ray's daemons polling); it is
taken off the top. With cores = inf nothing is shared and every piece of work takes its own time: the
engine-bound prediction.

How a job's waits are spread (`HostModel.scheduler`):

    fluid     every job progresses at `share` all the time: T of work takes T / share, and each job waits
              (1 / share - 1) seconds off the cores per second of its work
    sliced    the same wait on average, but each job's is drawn: its wait per second of work is
              (1 / share - 1) x f, f drawn from Exp(1) when it starts (seeded: the same inputs, the same draws)

A kernel hands the cores out in slices: a short step may run through untouched or wait for the whole slices
of the threads ahead of it. Measured on the 2-core machine (a decode worker's steps beside its prefill worker's
steps and a KV stream, 8 req/s, `/proc/.../schedstat`): the extra time of those steps was run-queue wait (no GIL
or other blocking to speak of), 1.19 ms at p50, 5.13 at p90 and 9.51 at p99 for steps of 4.3 ms of CPU; Exp
draws of the same mean (2.06 ms) put them at 1.43, 4.74 and 9.49. `fluid` puts every such step at its mean and
so misses the tail of the inter-token times (docs/benchmarks.md, "Where the decode worker's slow steps wait").
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

FINISHED = 1e-12  # seconds of work left that count as done (rounding of rate x time)
FLUID, SLICED = "fluid", "sliced"
SCHEDULERS = (FLUID, SLICED)


@dataclass(frozen=True)
class HostModel:
    """The host's cores and the threads its work runs on (see the module docstring); what the serving path
    costs is ServingCosts'."""

    cores: float = math.inf
    worker_threads: int = 1
    transfer_threads: int = 2
    scheduler: str = FLUID   # how a job's waits are spread: FLUID or SLICED (the module docstring)
    wait_seed: int = 0       # SLICED: the seed of the draws

    def __post_init__(self) -> None:
        if not self.cores > 0 or self.worker_threads < 1 or self.transfer_threads < 0:
            raise ValueError(f"a host needs cores > 0 and worker threads >= 1, got {self}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}: one of {', '.join(SCHEDULERS)}")

    def share(self, threads: int, baseline_cores: float = 0.0) -> float:
        """Of a core, what each of `threads` runnable threads gets (1 when nothing runs) when `baseline_cores`
        are taken off the top."""
        if threads <= 0:
            return 1.0
        return min(1.0, (self.cores - baseline_cores) / threads)


@dataclass(frozen=True)
class ServingCosts:
    """The serving path's costs for one kind of deployment (colocated or disaggregated), fitted by `tandem plan
    --calibrate` (cluster/plan/calibrate.py): CPU per request, token and step and at idle (HostModel's), two
    fixed times that are not CPU of the host (ServingShape's): before every first token, and in every step (its
    mean: each step's is drawn, lognormal with sigma `step_overhead_sigma`, as a real step's time beyond the step
    model's is a little for most steps and a few milliseconds for some)."""

    request_cpu_s: float = 0.0
    token_cpu_s: float = 0.0
    baseline_cores: float = 0.0
    request_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    step_cpu_s: float = 0.0
    step_overhead_sigma: float = 0.0

    def __post_init__(self) -> None:
        if min(self.request_cpu_s, self.token_cpu_s, self.baseline_cores, self.request_overhead_s,
               self.step_overhead_s, self.step_cpu_s, self.step_overhead_sigma) < 0:
            raise ValueError(f"serving costs must be >= 0, got {self}")

    def as_dict(self) -> dict[str, float]:
        return {"request_cpu_ms": self.request_cpu_s * 1e3, "token_cpu_ms": self.token_cpu_s * 1e3,
                "baseline_cores": self.baseline_cores, "request_overhead_ms": self.request_overhead_s * 1e3,
                "step_overhead_ms": self.step_overhead_s * 1e3, "step_cpu_ms": self.step_cpu_s * 1e3,
                "step_overhead_sigma": self.step_overhead_sigma}

    @classmethod
    def from_dict(cls, data: dict) -> "ServingCosts":
        """The inverse of as_dict; ValueError when a key is missing or a value is not a number >= 0."""
        try:
            return cls(float(data["request_cpu_ms"]) / 1e3, float(data["token_cpu_ms"]) / 1e3,
                       float(data["baseline_cores"]), float(data["request_overhead_ms"]) / 1e3,
                       float(data["step_overhead_ms"]) / 1e3, float(data.get("step_cpu_ms", 0.0)) / 1e3,
                       float(data.get("step_overhead_sigma", 0.0)))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not saved serving costs ({type(error).__name__}: {error})") from None


@dataclass(eq=False)
class Job:
    """Work of `threads` threads that takes `work` seconds at a full core per thread; `payload` is the caller's.
    `wait_factor` scales its waits off the cores (1: the fluid share's; the module docstring)."""

    work: float
    threads: int
    payload: object
    wait_factor: float = 1.0
    remaining: float = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = self.work

    def rate(self, share: float) -> float:
        """Seconds of work done per second at `share`: `share` itself when wait_factor is 1."""
        if share >= 1.0 or share <= 0.0:
            return min(1.0, max(share, 0.0))
        return 1.0 / (1.0 + (1.0 / share - 1.0) * self.wait_factor)


class CoreSharing:
    """The jobs running on the host and the serving path's queued CPU work, advanced through time.

    The caller (the simulation) calls `advance(now)` before every change (`start`, `add_serving_work`), and
    after it asks `next_change(now)`: until then the shares stay as they are, so nothing finishes earlier.
    `pop_finished` returns the jobs done by `now`, in the order they were started."""

    def __init__(self, host: HostModel, baseline_cores: float = 0.0) -> None:
        self.host, self.baseline_cores = host, baseline_cores
        self._waits = random.Random(host.wait_seed) if host.scheduler == SLICED else None
        self.jobs: list[Job] = []
        self.serving_backlog = 0.0   # CPU seconds of serving-path work queued
        self.serving_cpu = 0.0       # CPU seconds of serving-path work done so far
        self.jobs_cpu = 0.0          # CPU seconds of the jobs started so far (work x threads)
        self.clock = 0.0

    @property
    def runnable_threads(self) -> int:
        return sum(job.threads for job in self.jobs) + (1 if self.serving_backlog > FINISHED else 0)

    @property
    def share(self) -> float:
        return self.host.share(self.runnable_threads, self.baseline_cores)

    def advance(self, now: float) -> None:
        """Runs everything from the last call to `now` at the current share (now must not be past next_change)."""
        elapsed = now - self.clock
        if elapsed < 0:
            raise ValueError(f"time runs forward: {now} < {self.clock}")
        if elapsed > 0:
            share = self.share
            for job in self.jobs:
                job.remaining -= job.rate(share) * elapsed
            served = min(self.serving_backlog, share * elapsed)
            self.serving_backlog -= served
            self.serving_cpu += served
        self.clock = now

    def start(self, work: float, threads: int, payload: object) -> Job:
        """A job from `clock` on (call advance first)."""
        if work < 0 or threads < 0:
            raise ValueError(f"a job needs work >= 0 and threads >= 0, got {work}, {threads}")
        job = Job(work, threads, payload, 1.0 if self._waits is None else self._waits.expovariate(1.0))
        self.jobs.append(job)
        self.jobs_cpu += work * threads
        return job

    def add_serving_work(self, cpu_seconds: float) -> None:
        self.serving_backlog += cpu_seconds

    def next_change(self) -> float | None:
        """When the next job finishes or the serving path runs out of work (None: nothing will change)."""
        share = self.share
        if share == 0:
            return None
        ends = [max(0.0, job.remaining) / job.rate(share) for job in self.jobs]
        if self.serving_backlog > FINISHED:
            ends.append(self.serving_backlog / share)
        return self.clock + min(ends) if ends else None

    def pop_finished(self) -> list[Job]:
        done = [job for job in self.jobs if job.remaining <= FINISHED * max(1.0, job.work)]
        if done:
            self.jobs = [job for job in self.jobs if job.remaining > FINISHED * max(1.0, job.work)]
        if self.serving_backlog <= FINISHED:
            self.serving_cpu += self.serving_backlog
            self.serving_backlog = 0.0
        return done
