"""The calibration's fit against runs made from known serving costs (it recovers them), and the CPU time of a
process tree read from /proc against what the processes say they used."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from cluster.bench.serve_metrics import RequestResult
from cluster.plan.calibrate import (CpuReading, MeasuredRun, calibration_deployments, cpu_by_kind, fit_costs,
                                    latency_medians)
from cluster.plan.deployment import Deployment
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import HostModel, ServingCosts
from cluster.plan.process_cpu import ProcessCpu, cpu_between, snapshot
from cluster.plan.simulator import ServingShape, SimRequest, simulate, simulate_with_usage
from cluster.plan.step_model import FEATURES, StepTimeModel
from cluster.plan.tp_model import TpCost
from cluster.plan.transfer_model import TransferModel

MODEL = StepTimeModel(tuple({"step": 0.002, "prefill_tokens": 1e-4, "decode_rows": 0.001}.get(name, 0.0)
                            for name in FEATURES))
LIMITS = EngineLimits(256)
SHAPE = ServingShape(LIMITS, LIMITS, LIMITS, TransferModel(1000, 16, 1e7, 0.002, "test"), host=HostModel(cores=2),
                     tp_costs=(TpCost(2, 0.0005, 2e-6),))  # what a TP=2 group's collectives add to its steps


# TP groups on a host with cores beside their ranks: where the ranks take every core, the serving path's CPU and the
# ranks' contention for the cores trade against each other and the fit cannot tell them apart.
FITTED = [Deployment(0, 2), Deployment(1, 1), Deployment(0, 1, 1, 2), Deployment(1, 2, 2, 1)]


def shape_for(deployment: Deployment) -> ServingShape:
    tp = max(deployment.prefill_tp, deployment.decode_tp)
    return SHAPE if tp == 1 else replace(SHAPE, host=HostModel(cores=4))


def made_run(deployment: Deployment, costs: ServingCosts, output_len: int, gap_s: float = 0.5) -> MeasuredRun:
    """A run as a server with exactly `costs` would have measured it: the simulation's token times, and the CPU
    of its steps and transfers plus the baseline and the requests', tokens' and steps' serving CPU."""
    requests = [SimRequest(gap_s * k, 64, output_len) for k in range(20)]
    traces, usage = simulate_with_usage(deployment, requests, MODEL, replace(shape_for(deployment), costs=costs))
    results = tuple(RequestResult(True, t.request.prompt_len, t.request.arrival_s, t.token_times,
                                  (1,) * len(t.token_times)) for t in traces)
    seconds = max(t.token_times[-1] for t in traces)
    cpu = (usage.jobs_cpu_s + costs.baseline_cores * seconds + costs.request_cpu_s * len(requests)
           + costs.token_cpu_s * sum(r.output_len for r in requests) + costs.step_cpu_s * usage.steps)
    return MeasuredRun(tuple(requests), results, seconds, cpu)


def made_runs(deployment: Deployment, costs: ServingCosts) -> list[MeasuredRun]:
    """Many tokens per request, few, and a burst (many tokens per step), as calibrate() measures them."""
    return [made_run(deployment, costs, 32), made_run(deployment, costs, 2), made_run(deployment, costs, 32, 0.0)]


def test_calibration_serves_the_plans_tp_sizes():
    assert [d.name for d in calibration_deployments(2)] == ["colocated-2", "disagg-1p1d"]
    assert [d.name for d in calibration_deployments(1)] == ["colocated-1"]
    assert calibration_deployments(4, prefill_tp=2, decode_tp=1, replica_tp=2) == \
        [Deployment(0, 2, 1, 2), Deployment(1, 2, 2, 1)]
    assert calibration_deployments(3, prefill_tp=2, decode_tp=2) == [Deployment(0, 3)]  # no decode worker fits


@pytest.mark.parametrize("deployment", FITTED)
def test_the_fit_recovers_the_costs_a_run_was_made_with(deployment):
    truth = ServingCosts(request_cpu_s=0.004, token_cpu_s=0.0005, baseline_cores=0.05, request_overhead_s=0.01,
                         step_overhead_s=0.0015, step_cpu_s=0.0008)
    runs = made_runs(deployment, truth)
    fitted = fit_costs(runs, truth.baseline_cores, deployment, MODEL, shape_for(deployment))
    for name in ("request_cpu_s", "token_cpu_s", "step_cpu_s", "request_overhead_s", "step_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05, abs=2e-5), name
    # and the latencies it predicts with them are the run's
    traces = simulate(deployment, list(runs[0].requests), MODEL, replace(shape_for(deployment), costs=fitted))
    simulated = [RequestResult(True, 64, t.request.arrival_s, t.token_times, (1,) * len(t.token_times))
                 for t in traces]
    assert latency_medians(simulated) == pytest.approx(latency_medians(runs[0].results), rel=0.02)


@pytest.mark.parametrize("deployment", FITTED[:2] + FITTED[3:])
def test_the_fit_recovers_how_widely_the_step_overheads_spread(deployment):
    truth = ServingCosts(token_cpu_s=0.0005, step_overhead_s=0.0015, step_overhead_sigma=1.2)
    fitted = fit_costs(made_runs(deployment, truth), 0.0, deployment, MODEL, shape_for(deployment))
    assert fitted.step_overhead_sigma == pytest.approx(1.2, abs=0.2)
    assert fitted.step_overhead_s == pytest.approx(0.0015, rel=0.1)
    steady = fit_costs(made_runs(deployment, replace(truth, step_overhead_sigma=0.0)), 0.0, deployment, MODEL,
                       shape_for(deployment))
    assert steady.step_overhead_sigma == pytest.approx(0.0, abs=0.2)


def test_no_serving_work_fits_zero_costs():
    deployment = Deployment(0, 2)
    runs = made_runs(deployment, ServingCosts())
    fitted = fit_costs(runs, 0.0, deployment, MODEL, SHAPE)
    assert fitted.as_dict() == pytest.approx(ServingCosts().as_dict(), abs=1e-9)


def test_the_cpu_of_a_process_tree_is_what_its_processes_used():
    burn = ("import time, sys\n"
            "while time.process_time() < 0.3: pass\n"
            "print(time.process_time(), flush=True)\n"
            "sys.stdin.read()\n")                      # stays alive until the test has read its CPU
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = snapshot(child.pid)
        used = float(child.stdout.readline())
        after = snapshot(child.pid)
        (process,) = [p for p in cpu_between(before, after) if p.pid == child.pid]
        assert process.cpu_s + before[child.pid].cpu_s == pytest.approx(used, abs=0.05)  # /proc counts in ticks
        assert process.name == sys.executable
        assert child.pid in snapshot(os.getpid())  # this process's tree holds its child
    finally:
        child.stdin.close()
        child.wait()


def test_cpu_by_kind_counts_every_process_of_the_server_and_the_client():
    # the idle baseline once read only the client's CPU: Ray's daemons and the workers' loops (0.05 cores on the
    # 2-core machine) were then charged to every request
    before = CpuReading(0.0, 1.0, {10: ProcessCpu(10, "tandem", 2.0), 11: ProcessCpu(11, "ray::DecodeActor", 5.0),
                                   12: ProcessCpu(12, "gcs_server", 1.0),
                                   14: ProcessCpu(14, "ray::DashboardAgent", 0.5)})
    after = CpuReading(6.0, 1.1, {10: ProcessCpu(10, "tandem", 2.06), 11: ProcessCpu(11, "ray::DecodeActor", 5.12),
                                  12: ProcessCpu(12, "gcs_server", 1.15), 13: ProcessCpu(13, "ray::PrefillActor", 0.03),
                                  14: ProcessCpu(14, "ray::DashboardAgent", 0.52)})
    used = cpu_by_kind(10, before, after)
    assert used == pytest.approx({"client": 0.1, "serve": 0.06, "workers": 0.15, "ray": 0.17})
