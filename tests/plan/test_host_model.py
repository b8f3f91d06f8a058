"""The host model against hand-computed cases: processor sharing of the cores between jobs that start and end
at different times, the serving path's queued CPU work taking its thread's share, in the simulation steps and
KV transfers slowed by what else runs beside them (and not slowed where the cores suffice), and the sliced
scheduler's drawn waits: the fluid share's on average, spread as exponential draws."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from cluster.plan.deployment import Deployment
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import FLUID, SLICED, CoreSharing, HostModel, ServingCosts
from cluster.plan.simulator import ServingShape, SimRequest, simulate
from cluster.plan.step_model import FEATURES, StepTimeModel
from cluster.plan.transfer_model import TransferModel


def step_model(**seconds) -> StepTimeModel:
    return StepTimeModel(tuple(seconds.get(name, 0.0) for name in FEATURES))


def shape(host: HostModel, latency_s: float = 0.0, request_cpu_s: float = 0.0) -> ServingShape:
    limits = EngineLimits(2048)
    return ServingShape(limits, limits, limits, TransferModel(1000, 16, 1e4, latency_s, "test"),
                        ServingCosts(request_cpu_s=request_cpu_s), host)


def run_until_idle(sharing: CoreSharing) -> list[tuple[str, float]]:
    """Advances from change to change; (job, when it finished) in order."""
    ended = []
    while (when := sharing.next_change()) is not None:
        sharing.advance(when)
        ended += [(job.payload, when) for job in sharing.pop_finished()]
    return ended


def test_each_runnable_thread_gets_an_equal_share_of_the_cores_at_most_one():
    host = HostModel(cores=2)
    assert host.share(0, 0.5) == 1.0 and host.share(1, 0.5) == 1.0
    assert host.share(3, baseline_cores=0.5) == pytest.approx(0.5)      # (2 - 0.5) / 3
    assert HostModel().share(1000) == 1.0           # cores = inf: nothing is shared
    for bad in (dict(cores=0), dict(worker_threads=0), dict(scheduler="cfs")):
        with pytest.raises(ValueError):
            HostModel(**bad)
    with pytest.raises(ValueError):
        ServingCosts(token_cpu_s=-1)
    limits = EngineLimits(2048)
    with pytest.raises(ValueError, match="below the host's 2 cores"):
        ServingShape(limits, limits, limits, TransferModel(1000, 16, 1e4, 0.0, "test"), ServingCosts(baseline_cores=2),
                     host)


def test_jobs_that_overlap_share_one_core_and_each_finishes_its_own_work():
    sharing = CoreSharing(HostModel(cores=1))
    sharing.start(1.0, 1, "a")
    sharing.advance(0.5)                 # a alone: 0.5 s done
    sharing.start(1.0, 1, "b")           # from now on half a core each
    # a: 0.5 left at 0.5 -> ends at 1.5; b then has 0.5 done and runs alone: ends at 2.0
    assert run_until_idle(sharing) == [("a", pytest.approx(1.5)), ("b", pytest.approx(2.0))]


def test_a_job_of_two_threads_counts_twice():
    sharing = CoreSharing(HostModel(cores=2))
    sharing.start(0.3, 2, "transfer")
    sharing.start(0.3, 1, "step")        # 3 threads on 2 cores: 2/3 each
    assert sharing.share == pytest.approx(2 / 3)
    assert run_until_idle(sharing) == [("transfer", pytest.approx(0.45)), ("step", pytest.approx(0.45))]


def test_queued_serving_work_is_one_more_thread_until_it_is_done():
    sharing = CoreSharing(HostModel(cores=2))
    sharing.start(1.0, 1, "x")
    sharing.start(1.0, 1, "y")
    sharing.add_serving_work(0.3)        # 3 threads: 2/3 each; the 0.3 s are done at 0.45
    assert sharing.next_change() == pytest.approx(0.45)
    # by then x and y have 0.7 s left at a full core each
    assert run_until_idle(sharing) == [("x", pytest.approx(1.15)), ("y", pytest.approx(1.15))]
    assert sharing.serving_cpu == pytest.approx(0.3) and sharing.serving_backlog == 0.0


def test_replicas_steps_slow_down_while_the_serving_path_works_for_their_requests():
    model = step_model(prefill_tokens=0.01)  # a 100-token prompt: a 1 s step
    requests = [SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)]
    alone = simulate(Deployment(0, 2), requests, model, shape(HostModel(cores=2)))
    assert [t.token_times for t in alone] == [pytest.approx((1.0,))] * 2
    served = simulate(Deployment(0, 2), requests, model, shape(HostModel(cores=2), request_cpu_s=0.15))
    assert [t.token_times for t in served] == [pytest.approx((1.15,))] * 2  # as in the case above
    one_core = simulate(Deployment(0, 2), requests, model, shape(HostModel(cores=1)))
    assert [t.token_times for t in one_core] == [pytest.approx((2.0,))] * 2
    unshared = simulate(Deployment(0, 2), requests, model, shape(HostModel(cores=math.inf), request_cpu_s=0.15))
    assert [t.token_times for t in unshared] == [pytest.approx((1.0,))] * 2


def test_a_kv_transfers_copy_and_the_decode_steps_beside_it_slow_each_other_but_not_its_wait():
    model = step_model(prefill_tokens=0.001, decode_rows=0.1)
    a, b = SimRequest(0.0, 16, 3), SimRequest(0.25, 16, 2)  # one block each: 0.1 s wait + 0.1 s copy at 10 kB/s
    first, second = simulate(Deployment(1, 1), [a, b], model, shape(HostModel(cores=2), latency_s=0.1))
    # a: prefill 0.016, wait to 0.116, copy alone to 0.216 (first token), decode steps from 0.216 and 0.316.
    # b: prefill 0.25-0.266 beside a's step (2 threads: a core each), waits to 0.366 taking no core, then copies
    # with 2 threads beside a's second step: 2/3 of a core each. a's step has 0.05 left -> ends 0.441; the copy
    # has done 0.05 by then and the rest alone -> lands 0.491; b's decode step ends 0.591
    assert first.token_times == pytest.approx((0.216, 0.316, 0.441))
    assert second.token_times == pytest.approx((0.491, 0.591))
    plenty = simulate(Deployment(1, 1), [a, b], model, shape(HostModel(cores=4), latency_s=0.1))
    assert plenty[0].token_times == pytest.approx((0.216, 0.316, 0.416))  # every thread has a core
    assert plenty[1].token_times == pytest.approx((0.466, 0.566))


def test_sliced_waits_are_drawn_per_job_from_the_seed_and_scale_the_fair_shares_wait():
    sharing = CoreSharing(HostModel(cores=1, scheduler=SLICED, wait_seed=7))
    draws = random.Random(7)
    factor_a, factor_b = draws.expovariate(1.0), draws.expovariate(1.0)
    sharing.start(1.0, 1, "a")
    sharing.start(1.0, 1, "b")           # half a core each: 1 s of work waits 1 s in the fluid model, f x 1 s here
    first, second = ("a", factor_a), ("b", factor_b)
    if factor_b < factor_a:
        first, second = second, first
    ends_first = 1.0 + first[1]           # at 1 / (1 + f) seconds of work per second
    left = 1.0 - ends_first / (1.0 + second[1])
    assert run_until_idle(sharing) == [(first[0], pytest.approx(ends_first)),
                                       (second[0], pytest.approx(ends_first + left))]  # then alone: a full core


def test_sliced_waits_keep_the_fluid_mean_and_spread_it_as_an_exponential_tail():
    def short_steps(scheduler: str) -> list[float]:
        """2000 steps of 10 ms, one after another, beside a job that never ends on one core (half a core each)."""
        sharing = CoreSharing(HostModel(cores=1, scheduler=scheduler, wait_seed=3))
        sharing.start(1e9, 1, "background")
        times = []
        for _ in range(2000):
            started = sharing.clock
            sharing.start(0.01, 1, "step")
            when = sharing.next_change()
            sharing.advance(when)
            assert [job.payload for job in sharing.pop_finished()] == ["step"]
            times.append(when - started)
        return times

    assert set(round(t, 9) for t in short_steps(FLUID)) == {0.02}
    sliced = sorted(short_steps(SLICED))
    assert statistics.mean(sliced) == pytest.approx(0.02, rel=0.06)       # 10 ms of work + 10 ms waited on average
    assert sliced[0] < 0.0101 and sliced[1000] < 0.018                     # many barely wait: the median f is ln 2
    assert 0.045 < sliced[1980] < 0.07                                     # p99: f = ln 100 = 4.6, not 1
