"""Tensor-parallel workers in the planner: a split counted in devices (P x A + D x B <= G), the TP step model
(compute / T + the collectives' cost) and its fit, TP groups in the simulation, GPUs per role in the table and
the JSON, and the tie-break by devices. CPU only, no engine: hand-made step models."""
from __future__ import annotations

import pytest

from cluster.bench.serve_metrics import RequestResult, compute_metrics
from cluster.plan.deployment import Deployment, check_tp_sizes, deployments_for
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import HostModel
from cluster.plan.predict import Prediction, Slos, predict, recommend
from cluster.plan.report import format_table, format_tp, plan_json
from cluster.plan.simulator import ServingShape, SimRequest, simulate, simulate_with_usage
from cluster.plan.step_model import FEATURES, StepTimeModel, StepWork
from cluster.plan.tp_model import TpCost, TpStepModel, fit_tp_cost, group_model, parse_tp_cost
from cluster.plan.transfer_model import TransferModel


def step_model(**seconds) -> StepTimeModel:
    return StepTimeModel(tuple(seconds.get(name, 0.0) for name in FEATURES))


def shape(tp_costs=(), host: HostModel = HostModel()) -> ServingShape:
    worker = EngineLimits(512, 0, 256)
    transfer = TransferModel(1000, 16, 1e9, 0.0, "test")
    return ServingShape(worker, worker, EngineLimits(512, 0, 256), transfer, host=host, tp_costs=tuple(tp_costs))


@pytest.mark.parametrize("budget, sizes, expected", [
    (4, (1, 1, 1), ["colocated-4", "disagg-1p3d", "disagg-2p2d", "disagg-3p1d"]),
    (4, (2, 1, 2), ["colocated-2-tp2", "disagg-1p2d-ptp2"]),
    (8, (2, 2, 2), ["colocated-4-tp2", "disagg-1p3d-ptp2-dtp2", "disagg-2p2d-ptp2-dtp2", "disagg-3p1d-ptp2-dtp2"]),
    (8, (2, 4, 1), ["colocated-8", "disagg-2p1d-ptp2-dtp4"]),   # 1p1d (6 GPUs) leaves room for a prefill worker
    (6, (2, 3, 1), ["colocated-6", "disagg-1p1d-ptp2-dtp3"]),   # 5 of 6: no worker fits in the one left
])
def test_a_split_is_counted_in_devices_and_leaves_no_room_for_another_worker(budget, sizes, expected):
    deployments = deployments_for(budget, *sizes)
    assert [d.name for d in deployments] == expected
    colocated, *splits = deployments
    assert colocated.num_devices == budget and colocated.decode_tp == sizes[2]
    for d in splits:
        assert d.prefill_devices == d.num_prefill * sizes[0] and d.decode_devices == d.num_decode * sizes[1]
        assert d.num_devices <= budget and budget - d.num_devices < min(sizes[:2])


@pytest.mark.parametrize("budget, sizes, message", [
    (4, (3, 1, 1), "--prefill-tp 3 does not divide the budget of 4"),
    (4, (1, 3, 1), "--decode-tp 3 does not divide"),
    (6, (1, 1, 4), "--tp 4 does not divide"),
    (4, (0, 1, 1), "--prefill-tp must be an integer >= 1, got 0"),
    (4, (1, -2, 1), "--decode-tp must be an integer >= 1, got -2"),
    (4, (2, 4, 1), "--prefill-tp 2 + --decode-tp 4 is more than the 4"),
    (0, (1, 1, 1), "--gpus/--workers must be >= 1"),
])
def test_bad_budgets_and_tp_sizes_name_the_flag(budget, sizes, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        deployments_for(budget, *sizes)
    with pytest.raises(ValueError, match="colocated replicas have no prefill"):
        Deployment(0, 2, prefill_tp=2)


def test_tp_step_model_divides_compute_and_adds_the_collectives():
    base = step_model(step=0.002, prefill_tokens=1e-4, decode_rows=1e-3)
    decode, prefill = StepWork((), (100,) * 8), StepWork(((512, 0),))
    assert TpStepModel(base).seconds(decode) == base.seconds(decode)
    cost = TpCost(2, 0.0005, 2e-6)
    group = TpStepModel(base, 2, cost)
    assert group.seconds(decode) == pytest.approx(0.002 + 0.008 / 2 + 0.0005 + 8 * 2e-6)
    assert group.seconds(prefill) == pytest.approx(0.002 + 0.0512 / 2 + 0.0005 + 512 * 2e-6)
    assert group.seconds(StepWork()) == 0.0
    ideal = TpStepModel(base, 4, TpCost(4, 0.0, 0.0))
    assert ideal.seconds(prefill) == pytest.approx(0.002 + 0.0512 / 4)
    fitted = fit_tp_cost(2, base, [(prefill, group.seconds(prefill)), (decode, group.seconds(decode))], "test")
    assert (fitted.step_s, fitted.token_s) == pytest.approx((0.0005, 2e-6))
    faster = fit_tp_cost(2, base, [(decode, 0.001), (prefill, 0.002)], "test")  # below the ideal: no cost
    assert (faster.step_s, faster.token_s) == (0.0, 0.0)
    with pytest.raises(ValueError, match="needs the TpCost of that size"):
        TpStepModel(base, 2, TpCost(4, 0.0, 0.0))
    with pytest.raises(ValueError, match="--tp-cost 2:STEP_MS:TOKEN_US"):
        group_model(base, 2, (TpCost(4, 0.0, 0.0),))


def test_tp_costs_from_the_flag_and_back_from_a_saved_profile():
    cost = parse_tp_cost("2:0.3:1.5")
    assert (cost.tp, cost.step_s, cost.token_s) == (2, pytest.approx(3e-4), pytest.approx(1.5e-6))
    assert TpCost.from_dict(cost.as_dict()) == cost
    for bad in ("2:0.3", "1:0:0", "2:-1:0", "x:0:0", "2:fast:0"):
        with pytest.raises(ValueError, match="--tp-cost"):
            parse_tp_cost(bad)


def test_a_tp_group_steps_faster_on_its_devices_and_runs_tp_times_the_threads():
    requests = [SimRequest(0.0, 64, 20) for _ in range(4)]
    base = step_model(step=0.001, prefill_tokens=1e-4, decode_rows=0.004)
    ideal = (TpCost(2, 0.0, 0.0),)
    one, two = Deployment(0, 1), Deployment(0, 1, decode_tp=2)
    itl = lambda traces: traces[0].token_times[-1] - traces[0].token_times[1]  # noqa: E731
    single = simulate(one, requests, base, shape(ideal))
    group = simulate(two, requests, base, shape(ideal))
    assert itl(group) < itl(single) * 0.7
    slowed = simulate(two, requests, base, shape((TpCost(2, 0.05, 0.0),)))  # collectives of 50 ms per step
    assert itl(slowed) > itl(single)
    _, usage_one = simulate_with_usage(one, requests, base, shape(ideal, HostModel(worker_threads=3)))
    _, usage_two = simulate_with_usage(two, requests, base, shape(ideal, HostModel(worker_threads=3)))
    assert usage_two.steps == usage_one.steps
    assert usage_two.jobs_cpu_s > usage_one.jobs_cpu_s  # 2 x 3 threads on a step of more than half the time
    with pytest.raises(ValueError, match="--tp-cost 2"):
        simulate(two, requests, base, shape())


def _prediction(deployment: Deployment, ttft: float) -> Prediction:
    results = [RequestResult(True, 10, 0.0, (ttft, ttft + 0.01)) for _ in range(4)]
    return Prediction(deployment, compute_metrics(results, 2.0, {"ttft": 1000, "tpot": 100}), 1.0, 0.0)


def test_the_table_and_json_count_gpus_per_role_and_ties_go_to_fewer_devices():
    slos = Slos(ttft_ms=1000, itl_ms=100)
    more, fewer = Deployment(1, 1, 2, 3), Deployment(1, 2, 2, 1)   # 5 and 4 of 6 GPUs
    wide, narrow = _prediction(more, 0.05), _prediction(fewer, 0.06)
    best = recommend([wide, narrow], slos)
    assert best.prediction is narrow  # the same goodput on fewer GPUs
    table = format_table([wide, narrow], best, slos, "GPUs")
    assert "GPUs" in table.splitlines()[0]
    assert "disagg-1p2d-ptp2" in table and "2P+2D=4" in table and "2P+3D=5" in table
    assert "recommendation: disagg-1p2d-ptp2 on 4 GPUs" in table
    rows = plan_json([wide, narrow], best, slos, {})["deployments"]
    assert {k: rows[1][k] for k in ("prefill_tp", "decode_tp", "prefill_gpus", "decode_gpus", "gpus")} == \
        {"prefill_tp": 2, "decode_tp": 1, "prefill_gpus": 2, "decode_gpus": 2, "gpus": 4}
    text = format_tp(6, "GPUs", (TpCost(2, 3e-4, 1.5e-6, "given"), TpCost(4, 0, 0)), (2,))
    assert "budget: 6 GPUs" in text and "TP=2 step: compute / 2 + 0.300 ms + 1.50 us" in text and "TP=4" not in text


def test_predict_scores_a_tp_split():
    requests = [SimRequest(0.1 * k, 64, 8) for k in range(6)]
    base = step_model(step=0.001, prefill_tokens=1e-5, decode_rows=0.001)
    prediction = predict(Deployment(1, 2, 2, 1), requests, base, shape((TpCost(2, 1e-4, 0.0),)),
                         Slos(ttft_ms=1000, itl_ms=100))
    assert prediction.attainment == 1.0 and prediction.mean_transfer_ms > 0
    check_tp_sizes(4, 2, 1, 2, "GPUs")  # a valid set raises nothing
