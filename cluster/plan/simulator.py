"""A discrete-event simulation of one deployment serving a workload, driven by the profiled step times.

Every worker is a SimEngine (cluster/plan/engine_sim.py) whose steps take StepTimeModel.seconds of what
they compute (a tensor-parallel worker's: TpStepModel's, cluster/plan/tp_model.py); a request that arrives during
a step joins the next one, as in a real worker's step loop.

    disaggregated  arrival (+ overhead) -> the coordinator's routing (decode worker with the least KV claimed,
                   then fewest requests; prefill worker with the fewest queued prompt tokens) -> prefill worker
                   queue -> chunked, packed prefill steps -> first token sampled -> KV transfer to the decode
                   worker (TransferModel; one transfer at a time per prefill/decode pair) -> the decode
                   worker admits it between two steps and emits the first token then (so the client's TTFT
                   has the transfer in it) -> continuous batching of decode steps, a token per running
                   request per step
    colocated      arrival (+ overhead) -> the replica with the least load in tokens (its requests + their
                   prompt tokens without a first token) -> chunked prefill within the replica's step budget,
                   after its running decodes (the decodes wait for the prefill chunks that share their step)

Every step and every KV transfer is work that runs on the host's cores (cluster/plan/host_model.py): with
the serving path's CPU costs and the host's cores given, a step or a transfer takes longer while more
threads want the cores than there are; with cores = inf (the default) each takes its own time.

A step takes the step model's time plus the serving path's fixed time per step, drawn for each step: lognormal
with the mean ServingCosts.step_overhead_s and the sigma step_overhead_sigma that --calibrate measured (in a real
server most steps take a little more than the model, a few take milliseconds more).

A request with one output token ends at its first token (nothing is shipped). Same inputs, same result:
the only draws are the host's (HostModel.scheduler 'sliced') and the steps' spread, from HostModel.wait_seed.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from cluster.plan.deployment import Deployment
from cluster.plan.engine_sim import EngineLimits, SimEngine, SimSequence, step_work
from cluster.plan.host_model import CoreSharing, HostModel, ServingCosts
from cluster.plan.step_model import StepTimeModel
from cluster.plan.tp_model import TpCost, TpStepModel, group_model
from cluster.plan.transfer_model import TransferModel


@dataclass(frozen=True)
class SimRequest:
    """One request of the workload: when it is sent (seconds from the start) and its lengths."""

    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class ServingShape:
    """How the workers of every deployment run: their engines' limits, the KV transfer, what the serving path
    outside the engines costs (`costs`: CPU per request, token and step, and the fixed times before every first
    token and in every step), the host's cores all of it runs on (`host`: how they are shared; a worker of T ranks
    steps on T x host.worker_threads threads) and what TP groups' collectives cost (`tp_costs`: cluster/plan/
    tp_model.py; one per TP size > 1 a deployment uses)."""

    prefill_limits: EngineLimits     # prefill workers
    decode_limits: EngineLimits      # decode workers
    replica_limits: EngineLimits     # colocated replicas
    transfer: TransferModel
    costs: ServingCosts = field(default_factory=ServingCosts)
    host: HostModel = field(default_factory=HostModel)
    tp_costs: tuple[TpCost, ...] = ()

    def __post_init__(self) -> None:
        if self.costs.baseline_cores >= self.host.cores:
            raise ValueError(f"the serving path's idle use ({self.costs.baseline_cores} cores) must be below the "
                             f"host's {self.host.cores} cores")


@dataclass(frozen=True)
class RequestTrace:
    """What the client would see: when the request was sent and when each token arrived."""

    request: SimRequest
    token_times: tuple[float, ...]


class _Worker:
    def __init__(self, index: int, limits: EngineLimits, model: TpStepModel, threads: int) -> None:
        self.index, self.model, self.threads = index, model, threads  # threads: of its step, every rank's
        self.engine = SimEngine(limits)
        self.busy = False
        self.live: dict[int, SimSequence] = {}  # requests routed here and not finished
        self.landed: list[SimSequence] = []     # KV landed during a step: admitted when it ends


class _Simulation:
    def __init__(self, deployment: Deployment, requests: list[SimRequest], model: StepTimeModel,
                 shape: ServingShape) -> None:
        self.deployment, self.requests, self.model, self.shape = deployment, requests, model, shape
        limits = shape.decode_limits if deployment.is_disaggregated else shape.replica_limits
        prefill, decode = (group_model(model, tp, shape.tp_costs)
                           for tp in (deployment.prefill_tp, deployment.decode_tp))
        threads = shape.host.worker_threads
        self.prefill = [_Worker(i, shape.prefill_limits, prefill, threads * deployment.prefill_tp)
                        for i in range(deployment.num_prefill)]
        self.decode = [_Worker(i, limits, decode, threads * deployment.decode_tp) for i in range(deployment.num_decode)]
        self.token_times: list[list[float]] = [[] for _ in requests]
        self.decode_of: dict[int, _Worker] = {}     # request -> its decode worker (disaggregated)
        self.transfers: dict[tuple[int, int], deque] = {}  # (prefill, decode) -> KV to ship, the first in flight
        self.cpu = CoreSharing(shape.host, shape.costs.baseline_cores)
        self.cpu_version = 0
        self.step_spread = random.Random(f"steps-{shape.host.wait_seed}")
        self.steps = 0
        self.events: list = []
        self.order = itertools.count()

    def run(self) -> list[RequestTrace]:
        for index, request in enumerate(self.requests):
            self._push(request.arrival_s + self.shape.costs.request_overhead_s, self._arrive, index)
        while self.events:
            now, _, handler, payload = heapq.heappop(self.events)
            handler(now, payload)
        return [RequestTrace(request, tuple(times)) for request, times in zip(self.requests, self.token_times)]

    def _push(self, when: float, handler, payload) -> None:
        heapq.heappush(self.events, (when, next(self.order), handler, payload))

    def _run_on_host(self, now: float, seconds: float, threads: int, handler, payload) -> None:
        """Work of `seconds` on a core per thread; `handler(end, payload)` when it is done at its share."""
        self.cpu.advance(now)
        self.cpu.start(seconds, threads, (handler, payload))
        self._host_changed()

    def _serving_work(self, now: float, cpu_seconds: float) -> None:
        if cpu_seconds > 0:
            self.cpu.advance(now)
            self.cpu.add_serving_work(cpu_seconds)
            self._host_changed()

    def _host_changed(self) -> None:
        """The shares changed: the one pending host event is the next job's end at the new shares."""
        self.cpu_version += 1
        when = self.cpu.next_change()
        if when is not None:
            self._push(when, self._host_tick, self.cpu_version)

    def _host_tick(self, now: float, version: int) -> None:
        if version != self.cpu_version:
            return
        self.cpu.advance(now)
        for job in self.cpu.pop_finished():
            handler, payload = job.payload
            handler(now, payload)
        self._host_changed()

    def _arrive(self, now: float, index: int) -> None:
        """Routes as cluster/coordinator/routing.py does, from the coordinator's own accounting: a decode worker
        by the most free blocks (its pool less prompt + max tokens of each request routed there), then the
        fewest requests; a prefill worker by the prompt tokens sent there and not yet reported (the report comes
        when the KV has landed); a replica by its requests plus the prompt tokens routed there without a first
        token."""
        request = self.requests[index]
        self._serving_work(now, self.shape.costs.request_cpu_s)
        if self.deployment.is_disaggregated:
            decode = min(self.decode, key=lambda w: (_claimed_tokens(w), len(w.live), w.index))
            prefill = min(self.prefill, key=lambda w: (_waiting_prompt_tokens(w), w.index))
            seq = SimSequence(index, request.prompt_len, request.output_len, prefill_only=True)
            self.decode_of[index] = decode
            decode.live[index] = prefill.live[index] = seq
            self._enqueue(prefill, seq, now)
        else:
            replica = min(self.decode, key=lambda w: (len(w.live) + _waiting_prompt_tokens(w), _claimed_tokens(w),
                                                      w.index))
            seq = SimSequence(index, request.prompt_len, request.output_len)
            replica.live[index] = seq
            self._enqueue(replica, seq, now)

    def _enqueue(self, worker: _Worker, seq: SimSequence, now: float) -> None:
        worker.engine.add_waiting(seq)
        self._start_step(worker, now)

    def _start_step(self, worker: _Worker, now: float) -> None:
        if worker.busy or not worker.engine.has_work:
            return
        chunks = worker.engine.schedule()
        worker.busy = True
        seconds = worker.model.seconds(step_work(chunks)) + self.shape.costs.step_overhead_s * self._spread()
        self._run_on_host(now, seconds, worker.threads, self._end_step, (worker, chunks))

    def _spread(self) -> float:
        """A draw of the step overhead's factor: lognormal with mean 1 and sigma ServingCosts.step_overhead_sigma
        (always 1 at sigma 0)."""
        sigma = self.shape.costs.step_overhead_sigma
        return self.step_spread.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0

    def _end_step(self, now: float, payload) -> None:
        worker, chunks = payload
        worker.busy = False
        self.steps += 1
        self._serving_work(now, self.shape.costs.step_cpu_s)
        for seq in worker.engine.finish_step(chunks):
            if seq.prefill_only:
                self._prefilled(worker, seq, now)
            else:
                self._token(worker, seq, now)
        for seq in worker.landed:
            self._admit(worker, seq, now)
        worker.landed.clear()
        self._start_step(worker, now)

    def _token(self, worker: _Worker, seq: SimSequence, now: float) -> None:
        self.token_times[seq.request].append(now)
        self._serving_work(now, self.shape.costs.token_cpu_s)
        if seq.is_done:
            worker.live.pop(seq.request, None)

    def _prefilled(self, prefill: _Worker, seq: SimSequence, now: float) -> None:
        """The first token is sampled: done if it is the only one, else ship the KV to the decode worker."""
        decode = self.decode_of[seq.request]
        if seq.output_len <= 1:
            prefill.live.pop(seq.request)
            self._token(decode, seq, now)
            return
        pair = (prefill.index, decode.index)
        queue = self.transfers.setdefault(pair, deque())
        queue.append((prefill, seq))
        if len(queue) == 1:
            self._start_transfer(now, pair)

    def _start_transfer(self, now: float, pair: tuple[int, int]) -> None:
        """The transfer's fixed cost is a wait (round trips: manifest, acknowledgement), not CPU; then its bytes
        are copied by its threads on the host's cores."""
        self._push(now + self.shape.transfer.latency_s, self._copy_kv, pair)

    def _copy_kv(self, now: float, pair: tuple[int, int]) -> None:
        _, seq = self.transfers[pair][0]
        transfer = self.shape.transfer
        self._run_on_host(now, transfer.seconds(seq.prompt_len) - transfer.latency_s,
                          self.shape.host.transfer_threads, self._landed, pair)

    def _landed(self, now: float, pair: tuple[int, int]) -> None:
        """The decode worker's step thread admits the request between steps, and then emits its first token;
        the pair's next transfer starts."""
        queue = self.transfers[pair]
        prefill, seq = queue.popleft()
        if queue:
            self._start_transfer(now, pair)
        prefill.live.pop(seq.request)
        decode = self.decode_of[seq.request]
        if decode.busy:
            decode.landed.append(seq)
            return
        self._admit(decode, seq, now)
        self._start_step(decode, now)

    def _admit(self, decode: _Worker, seq: SimSequence, now: float) -> None:
        self.token_times[seq.request].append(now)
        self._serving_work(now, self.shape.costs.token_cpu_s)
        seq.prefill_only = False
        decode.engine.add_running(seq)


def _claimed_tokens(worker: _Worker) -> int:
    """The KV its live requests may hold (prompt + every output token): the router's claimed blocks."""
    return sum(seq.prompt_len + seq.output_len for seq in worker.live.values())


def _waiting_prompt_tokens(worker: _Worker) -> int:
    """Prompt tokens of its live requests that have no first token out yet (the router's queued tokens); a
    prefill worker's live requests are those whose KV has not landed."""
    return sum(seq.prompt_len for seq in worker.live.values() if seq.num_generated == 0 or seq.prefill_only)


@dataclass(frozen=True)
class HostUsage:
    """CPU seconds a simulated run spent: in worker steps and KV transfers (work x threads), and on the
    serving path (shape.costs' of its requests, tokens and steps); and its steps, every worker's."""

    jobs_cpu_s: float
    serving_cpu_s: float
    steps: int


def simulate(deployment: Deployment, requests: list[SimRequest], model: StepTimeModel,
             shape: ServingShape) -> list[RequestTrace]:
    """Serves `requests` on `deployment` and returns each request's token times (seconds from the start),
    in the order of `requests`. Every request gets all its output tokens."""
    return simulate_with_usage(deployment, requests, model, shape)[0]


def simulate_with_usage(deployment: Deployment, requests: list[SimRequest], model: StepTimeModel,
                        shape: ServingShape) -> tuple[list[RequestTrace], HostUsage]:
    """simulate(), and the CPU the run spent."""
    for request in requests:
        if request.prompt_len < 1 or request.output_len < 1 or request.arrival_s < 0:
            raise ValueError(f"a simulated request needs a prompt and an output token and a time >= 0: {request}")
    simulation = _Simulation(deployment, list(requests), model, shape)
    traces = simulation.run()
    return traces, HostUsage(simulation.cpu.jobs_cpu, simulation.cpu.serving_cpu, simulation.steps)
