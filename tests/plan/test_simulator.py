"""The planner's queueing model against hand-computed cases: a deterministic single server, M/D/1's mean
wait (Pollaczek-Khinchine) over a long seeded run, the batching limits, the KV transfer, the interference of
prefill chunks with decode steps, the drawn step overheads, and the recommendation rule, including SLOs no
deployment meets."""
from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import pytest

from cluster.bench.serve_metrics import RequestResult, compute_metrics
from cluster.bench.serve_workloads import arrival_gaps
from cluster.plan.deployment import Deployment, deployments_for
from cluster.plan.engine_sim import EngineLimits
from cluster.plan.host_model import HostModel, ServingCosts
from cluster.plan.predict import Prediction, Slos, predict, recommend
from cluster.plan.simulator import ServingShape, SimRequest, simulate
from cluster.plan.step_model import FEATURES, StepTimeModel
from cluster.plan.transfer_model import TransferModel

PREFILL_1P = Deployment(1, 1)


def step_model(**seconds) -> StepTimeModel:
    """A model with the given per-unit seconds (FEATURES' names), 0 for the others."""
    unknown = set(seconds) - set(FEATURES)
    assert not unknown, unknown
    return StepTimeModel(tuple(seconds.get(name, 0.0) for name in FEATURES))


def shape(budget: int = 100, threshold: int = 0, max_seqs: int = 256, replica_budget: int = 8,
          bytes_per_block: int = 1000, bandwidth: float = 1e4, latency_s: float = 0.0,
          overhead_s: float = 0.0, step_overhead_s: float = 0.0) -> ServingShape:
    worker = EngineLimits(budget, threshold, max_seqs)
    transfer = TransferModel(bytes_per_block, 16, bandwidth, latency_s, "test")
    return ServingShape(worker, worker, EngineLimits(replica_budget, 0, max_seqs), transfer,
                        ServingCosts(request_overhead_s=overhead_s, step_overhead_s=step_overhead_s))


def ttfts(traces) -> list[float]:
    return [trace.token_times[0] - trace.request.arrival_s for trace in traces]


def test_a_deterministic_single_server_serves_each_request_in_its_service_time_or_queues_linearly():
    model = step_model(prefill_tokens=0.005)  # a 100-token prompt: 0.5 s, one per step (budget 100)
    spaced = [SimRequest(1.0 * k, 100, 1) for k in range(5)]
    assert ttfts(simulate(PREFILL_1P, spaced, model, shape())) == pytest.approx([0.5] * 5)
    crowded = [SimRequest(0.4 * k, 100, 1) for k in range(6)]  # arrivals outpace service by 0.1 s each
    assert ttfts(simulate(PREFILL_1P, crowded, model, shape())) == pytest.approx([0.5 + 0.1 * k for k in range(6)])
    late = simulate(PREFILL_1P, spaced, model, shape(overhead_s=0.02))  # the fixed cost lands in every TTFT
    assert ttfts(late) == pytest.approx([0.52] * 5)
    slower = simulate(PREFILL_1P, crowded, model, shape(step_overhead_s=0.05))  # 0.55 s per step, gaps of 0.4
    assert ttfts(slower) == pytest.approx([0.55 + 0.15 * k for k in range(6)])


def test_md1_mean_wait_matches_pollaczek_khinchine_on_a_long_seeded_run():
    service, rate = 0.5, 1.2  # rho = 0.6
    rho = rate * service
    expected_wait = rho * service / (2 * (1 - rho))  # M/D/1: Wq = rho / (2 mu (1 - rho))
    times = itertools.accumulate(arrival_gaps(20000, rate, 1.0, seed=5))
    requests = [SimRequest(t, 100, 1) for t in times]
    traces = simulate(PREFILL_1P, requests, step_model(prefill_tokens=service / 100), shape())
    waits = [ttft - service for ttft in ttfts(traces)]
    assert min(waits) == pytest.approx(0.0, abs=1e-9)
    assert sum(waits) / len(waits) == pytest.approx(expected_wait, rel=0.05)


def test_prompts_queued_behind_a_step_are_packed_into_the_next_within_the_batching_limits():
    model = step_model(step=0.01, prefill_tokens=0.001)
    first = SimRequest(0.0, 100, 1)  # 0.11 s step; the next three arrive during it
    behind = [SimRequest(0.001 * (k + 1), 256, 1) for k in range(3)]
    packed = simulate(PREFILL_1P, [first, *behind], model, shape(budget=2048, threshold=256))
    end = 0.11 + 0.01 + 3 * 0.256
    assert ttfts(packed) == pytest.approx([0.11] + [end - r.arrival_s for r in behind])
    two_at_once = simulate(PREFILL_1P, [first, *behind], model, shape(budget=2048, threshold=256, max_seqs=2))
    second, third = 0.11 + 0.01 + 2 * 0.256, 0.11 + 0.01 + 2 * 0.256 + 0.01 + 0.256
    assert ttfts(two_at_once) == pytest.approx([0.11, second - 0.001, second - 0.002, third - 0.003])


def test_a_long_prompt_is_prefilled_in_threshold_sized_chunks_whose_attention_adds_up_to_the_whole():
    chunked = simulate(PREFILL_1P, [SimRequest(0.0, 1000, 1)], step_model(step=0.01, prefill_tokens=0.001),
                       shape(budget=2048, threshold=256))
    assert ttfts(chunked) == pytest.approx([4 * 0.01 + 1.0])  # 256 + 256 + 256 + 232 tokens, 4 steps
    pairs = step_model(prefill_attention_pairs=1e-6)
    whole = simulate(PREFILL_1P, [SimRequest(0.0, 1000, 1)], pairs, shape(budget=2048))
    in_chunks = simulate(PREFILL_1P, [SimRequest(0.0, 1000, 1)], pairs, shape(budget=2048, threshold=256))
    assert ttfts(whole) == pytest.approx([1000 * 1001 / 2 * 1e-6])
    assert ttfts(in_chunks) == pytest.approx(ttfts(whole))


def test_the_first_token_waits_for_the_kv_transfer_then_decode_steps_pace_the_rest():
    model = step_model(prefill_tokens=0.001, decode_rows=0.1)
    trace, = simulate(PREFILL_1P, [SimRequest(0.0, 32, 3)], model, shape(latency_s=0.05))
    transfer = 0.05 + 2 * 1000 / 1e4  # 32 tokens = 2 blocks of 1000 bytes at 10 kB/s
    assert trace.token_times == pytest.approx((0.032 + transfer, 0.032 + transfer + 0.1, 0.032 + transfer + 0.2))


def test_drawn_step_overheads_keep_their_mean_spread_the_inter_token_times_and_follow_the_seed():
    model = step_model(decode_rows=0.004)
    request = [SimRequest(0.0, 16, 2001)]

    def gaps(sigma: float, seed: int = 0) -> list[float]:
        costs = ServingCosts(step_overhead_s=0.001, step_overhead_sigma=sigma)
        one = replace(shape(), costs=costs, host=HostModel(wait_seed=seed))
        trace, = simulate(Deployment(0, 1), request, model, one)
        return [later - earlier for earlier, later in zip(trace.token_times, trace.token_times[1:])]

    assert gaps(0.0) == pytest.approx([0.005] * 2000)              # 4 ms of decode + 1 ms overhead, every step
    spread = gaps(1.5)
    assert statistics.mean(spread) == pytest.approx(0.005, rel=0.05)  # the overhead's mean is kept
    assert min(spread) < 0.0045 and max(spread) > 0.009               # most steps a little, a few several ms
    assert sorted(spread)[1000] < 0.005 < sorted(spread)[1990]       # below its mean at p50, above at p99.5
    assert gaps(1.5) == spread and gaps(1.5, seed=1) != spread


def test_kv_landing_during_a_decode_step_is_admitted_and_its_first_token_sent_when_the_step_ends():
    model = step_model(prefill_tokens=0.001, decode_rows=0.1)
    first, second = simulate(PREFILL_1P, [SimRequest(0.0, 16, 3), SimRequest(0.15, 16, 2)], model, shape())
    # A lands at 0.016 + 0.1 on an idle decode worker; B lands at 0.266, inside A's step 0.216-0.316
    assert first.token_times == pytest.approx((0.116, 0.216, 0.316))
    assert second.token_times == pytest.approx((0.316, 0.416))


def test_transfers_of_one_prefill_decode_pair_go_one_at_a_time_and_different_pairs_in_parallel():
    model = step_model(prefill_tokens=0.001)
    requests = [SimRequest(0.0, 16, 1), SimRequest(0.001, 32, 2), SimRequest(0.002, 32, 2)]
    transfer = 2 * 1000 / 1e4
    one_decode = [t.token_times[0] for t in simulate(PREFILL_1P, requests, model, shape())]
    prefilled = 0.016 + 0.064  # the two 32-token prompts share the second step
    assert one_decode[1:] == pytest.approx([prefilled + transfer, prefilled + 2 * transfer])
    two_decodes = [t.token_times[0] for t in simulate(Deployment(1, 2), requests, model, shape())]
    assert two_decodes[1:] == pytest.approx([prefilled + transfer] * 2)


def test_a_replicas_decodes_wait_for_the_prefill_chunks_that_share_their_steps():
    model = step_model(prefill_tokens=0.01, decode_rows=0.001)
    decoding, arriving = SimRequest(0.0, 4, 4), SimRequest(0.0005, 14, 1)
    colocated = simulate(Deployment(0, 1), [decoding, arriving], model, shape(replica_budget=8))
    # steps: [A 4 tokens] 0.04; [A decode + B 7] 0.071; [A decode + B 7, B done] 0.071; [A decode] 0.001
    assert colocated[0].token_times == pytest.approx((0.04, 0.111, 0.182, 0.183))
    assert colocated[1].token_times == pytest.approx((0.182,))
    disaggregated = simulate(Deployment(1, 1), [decoding, arriving], model, shape(bandwidth=1e12))
    gaps = [b - a for a, b in zip(disaggregated[0].token_times, disaggregated[0].token_times[1:])]
    assert gaps == pytest.approx([0.001] * 3)  # the decode worker never runs a prefill


def test_deployments_are_every_split_of_the_workers_and_colocated_replicas():
    assert [d.name for d in deployments_for(4)] == ["colocated-4", "disagg-1p3d", "disagg-2p2d", "disagg-3p1d"]
    assert [d.name for d in deployments_for(1)] == ["colocated-1"]
    with pytest.raises(ValueError, match="--workers must be >= 1"):  # --gpus/--workers
        deployments_for(0)


def _scenario():
    """Colocated replicas answer in 0.1 s; the disaggregated split pays a 1 s transfer."""
    requests = [SimRequest(1.0 * k, 100, 4) for k in range(10)]
    model = step_model(prefill_tokens=0.001, decode_rows=0.001)
    return requests, model, shape(budget=512, replica_budget=512, latency_s=1.0)


def test_the_recommendation_is_the_best_goodput_within_the_slos():
    requests, model, serving = _scenario()
    slos = Slos(ttft_ms=500, itl_ms=100)
    predictions = [predict(d, requests, model, serving, slos) for d in deployments_for(2)]
    colocated, disagg = predictions
    assert colocated.attainment == 1.0 and disagg.attainment == 0.0 and disagg.goodput == 0.0
    assert colocated.goodput == pytest.approx(10 / colocated.metrics.duration)
    chosen = recommend(predictions, slos)
    assert chosen.meets_slos and chosen.prediction is colocated


def test_slos_no_deployment_meets_give_the_closest_and_say_so():
    requests, model, serving = _scenario()
    slos = Slos(ttft_ms=50, itl_ms=100)  # every TTFT is at least 0.1 s
    predictions = [predict(d, requests, model, serving, slos) for d in deployments_for(2)]
    assert all(p.attainment == 0.0 for p in predictions)
    chosen = recommend(predictions, slos)
    assert not chosen.meets_slos and chosen.prediction.deployment.name == "colocated-2"  # lower p99 TTFT


def _prediction(name: str, ttft: float, duration: float = 2.0) -> Prediction:
    results = [RequestResult(True, 10, 0.0, (ttft, ttft + 0.01)) for _ in range(4)]
    deployment = next(d for d in deployments_for(2) if d.name == name)
    return Prediction(deployment, compute_metrics(results, duration, {"ttft": 1000, "tpot": 100}), 1.0, 0.0)


def test_equal_goodputs_are_broken_by_the_lower_p99_ttft():
    slos = Slos(ttft_ms=1000, itl_ms=100)
    fast, slow = _prediction("disagg-1p1d", 0.05), _prediction("colocated-2", 0.2)
    assert recommend([slow, fast], slos).prediction is fast
    more = _prediction("colocated-2", 0.2, duration=1.0)  # twice the goodput wins over a lower TTFT
    assert recommend([fast, more], slos).prediction is more
    with pytest.raises(ValueError):
        Slos(ttft_ms=0, itl_ms=10)
