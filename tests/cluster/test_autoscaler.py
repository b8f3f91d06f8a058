"""The autoscaler's decisions on constructed snapshots (no Ray): each signal presses its role, hysteresis
(ticks in a row, the gap between up and down thresholds), cool-down, workers starting or draining, the
bounds, one change per tick; and the pieces around it: the latency window, the worker set's states,
the bounds and the serve flags."""
from __future__ import annotations

import argparse

import pytest

from cluster.backend import GenerationChunk, Timing
from cluster.coordinator.autoscaler import AutoscalePolicy, AutoscaleState, RoleSnapshot, ScaleSnapshot, decide
from cluster.coordinator.latency_window import LatencyWindow
from cluster.coordinator.worker_set import Worker, WorkerSet, WorkerState
from cluster.serve import add_arguments, config_from_args
from cluster.workers.actors import WorkerInfo
from cluster.workers.added_worker import BundleSlot
from cluster.workers.worker_bounds import WorkerBounds

POLICY = AutoscalePolicy(interval_s=1.0, cooldown_s=10.0, ttft_slo_ms=1000.0, itl_slo_ms=100.0,
                         prefill_queue_tokens=1000, decode_occupancy=0.8, free_blocks=0.1, low_ratio=0.5,
                         up_ticks=2, down_ticks=3)


def prefill(serving=1, queued=0, changing=0, minimum=1, maximum=4) -> RoleSnapshot:
    return RoleSnapshot("prefill", serving, changing, minimum, maximum, queued_tokens=queued)


def decode(serving=1, running=0, free=100, changing=0, minimum=1, maximum=4, capacity_each=10) -> RoleSnapshot:
    return RoleSnapshot("decode", serving, changing, minimum, maximum, running=running,
                        capacity=serving * capacity_each, free_blocks=free, total_blocks=100 * serving)


def run(snapshots, state=AutoscaleState()):
    """Decisions of consecutive ticks (one snapshot each) and the last state."""
    decisions = []
    for snapshot in snapshots:
        decision, state = decide(snapshot, POLICY, state)
        decisions.append(decision)
    return decisions, state


def ticks(count, *roles, start=100.0, **latency):
    return [ScaleSnapshot(start + i, roles, **latency) for i in range(count)]


@pytest.mark.parametrize("roles, latency, role, signal", [
    ((prefill(queued=1500), decode()), {}, "prefill", "queued prompt tokens per worker 1.5e+03"),
    ((prefill(), decode()), {"ttft_p90_ms": 1500.0}, "prefill", "TTFT p90 ms 1.5e+03"),
    ((prefill(), decode()), {"queue_p90_ms": 800.0}, "prefill", "queue p90 ms 800 (threshold 500)"),
    ((prefill(), decode(running=9)), {}, "decode", "batch occupancy 0.9"),
    ((prefill(), decode(free=5)), {}, "decode", "used KV blocks 0.95"),
    ((prefill(), decode()), {"itl_p90_ms": 150.0}, "decode", "ITL p90 ms 150"),
])
def test_each_signal_adds_a_worker_of_its_role_after_up_ticks_in_a_row(roles, latency, role, signal):
    decisions, _ = run(ticks(2, *roles, **latency))
    assert decisions[0] is None                      # one pressed tick is not enough (up_ticks 2)
    assert (decisions[1].role, decisions[1].delta) == (role, +1)
    assert signal in decisions[1].reason and "pressed for 2 ticks" in decisions[1].reason


def test_a_pressed_streak_broken_by_a_calm_tick_starts_over():
    hot, calm = (prefill(queued=1500), decode()), (prefill(queued=700), decode())
    snapshots = [ScaleSnapshot(100.0 + i, roles) for i, roles in enumerate([hot, calm, hot, hot])]
    decisions, _ = run(snapshots)
    assert decisions[:3] == [None, None, None] and decisions[3].role == "prefill"


def test_replicas_are_pressed_by_every_signal_and_drained_when_all_are_low():
    replica = RoleSnapshot("replica", 2, 0, 1, 3, queued_tokens=0, running=9, capacity=20, free_blocks=150,
                           total_blocks=200)
    decisions, _ = run(ticks(2, replica, ttft_p90_ms=2000.0))
    assert (decisions[1].role, decisions[1].delta) == ("replica", +1) and "TTFT" in decisions[1].reason
    quiet = RoleSnapshot("replica", 2, 0, 1, 3, running=1, capacity=20, free_blocks=190, total_blocks=200)
    decisions, _ = run(ticks(3, quiet, ttft_p90_ms=100.0, itl_p90_ms=10.0))
    assert decisions[:2] == [None, None] and (decisions[2].role, decisions[2].delta) == ("replica", -1)


def test_a_role_drains_only_when_idle_with_one_worker_fewer_for_down_ticks():
    # 2 decode workers, 3 of 20 running: with one fewer 3 / 10 = 0.3 < 0.5 x 0.8 -> idle
    idle = [ScaleSnapshot(100.0 + i, (prefill(), decode(serving=2, running=3, free=190))) for i in range(3)]
    decisions, _ = run(idle)
    assert decisions[:2] == [None, None] and (decisions[2].role, decisions[2].delta) == ("decode", -1)
    assert "idle for 3 ticks" in decisions[2].reason
    # 5 of 20 running: below the up threshold, but 5 / 10 = 0.5 is not below 0.4 with one fewer: the gap holds
    between = [ScaleSnapshot(100.0 + i, (prefill(), decode(serving=2, running=5, free=190))) for i in range(10)]
    assert run(between)[0] == [None] * 10


def test_missing_latencies_count_as_zero_and_high_latency_blocks_a_drain():
    roles = (prefill(serving=2), decode())
    assert run(ticks(3, *roles))[0][2].role == "prefill"                 # no samples: idle
    assert run(ticks(6, *roles, ttft_p90_ms=600.0))[0] == [None] * 6     # 600 > 0.5 x 1000: not idle


def test_cool_down_after_a_change_and_no_change_while_workers_start_or_drain():
    hot = (prefill(queued=1500), decode())
    decisions, state = run(ticks(2, *hot))
    assert decisions[1].role == "prefill"
    after, _ = run(ticks(12, prefill(serving=2, queued=3000), decode(), start=102.0), state)
    assert after[:9] == [None] * 9               # cooldown_s 10 from the change at t=101
    assert after[9] is not None and (after[9].role, after[9].delta) == ("prefill", 1)
    starting = ticks(5, prefill(queued=1500, changing=1), decode())
    assert run(starting)[0] == [None] * 5


def test_bounds_hold_both_ways():
    at_max = ticks(4, prefill(queued=5000, maximum=1), decode(running=10, maximum=1))
    assert run(at_max)[0] == [None] * 4
    at_min = ticks(5, prefill(serving=2, minimum=2), decode(serving=3, minimum=3))
    assert run(at_min)[0] == [None] * 5
    unbounded = ticks(2, prefill(queued=5000, maximum=None), decode())
    assert run(unbounded)[0][1].role == "prefill"


def test_one_change_per_tick_the_most_pressed_role_first_and_growth_before_drains():
    roles = (prefill(queued=1200), decode(running=10))   # prefill 1.2 x its threshold, decode 1.25
    decisions, state = run(ticks(2, *roles))
    assert decisions[1].role == "decode"
    # the prefill role is still pressed and not cooling down: it is added on the next tick
    decision, _ = decide(ScaleSnapshot(102.0, (prefill(queued=1200), decode(serving=2, running=10))), POLICY, state)
    assert decision.role == "prefill"
    # decode idle for 3 ticks as prefill is pressed for 2: the addition goes first, the drain a tick later
    roles = [(prefill(), decode(serving=2, free=200))] + [(prefill(queued=1500), decode(serving=2, free=200))] * 3
    mixed = [ScaleSnapshot(100.0 + i, r) for i, r in enumerate(roles)]
    assert [d and (d.role, d.delta) for d in run(mixed)[0]] == [None, None, ("prefill", 1), ("decode", -1)]


def test_no_serving_worker_of_a_role_presses_it():
    decisions, _ = run(ticks(2, prefill(serving=0), decode()))
    assert (decisions[1].role, decisions[1].delta) == ("prefill", 1) and "serving workers inf" in decisions[1].reason


def test_policy_checks_its_fields():
    for fields in ({"interval_s": 0}, {"decode_occupancy": 1.0}, {"low_ratio": 0}, {"up_ticks": 0},
                   {"cooldown_s": -1}, {"ttft_slo_ms": -5}):
        with pytest.raises(ValueError, match=next(iter(fields)).split("_")[0]):
            AutoscalePolicy(**fields)


def test_latency_window_percentiles_over_the_recent_window():
    window = LatencyWindow()
    for i in range(10):
        clock = window.request(arrival_time=0.0)
        clock.delivered(GenerationChunk((1,), "a"))
    summary = window.summary(now=1e9, window_s=1e12, min_samples=5)
    assert summary.requests == 10 and summary.ttft_p90_ms > 0 and summary.itl_p90_ms is None
    for i in range(20):
        window.record("itl", i / 1000, now=float(i))
    window.record("queue", 0.25, now=19.0)
    summary = window.summary(now=19.5, window_s=10.0, min_samples=5)   # keeps samples after t=9.5
    assert summary.itl_p90_ms == pytest.approx(19.0) and summary.queue_p90_ms is None
    assert window.summary(now=19.5, window_s=10.0, min_samples=1).queue_p90_ms == pytest.approx(250.0)
    clock = window.request(arrival_time=0.0)
    clock.delivered(GenerationChunk((1, 2), "ab"))
    final = clock.delivered(GenerationChunk((3, 4), "cd", "length", Timing(queue_ms=40.0)))
    assert final.timing.queue_ms == 40.0


def started_worker(name: str, role: str) -> Worker:
    return Worker(WorkerInfo(name, role, "cpu", "node", 1, (), 64, 16, 100, None), actor=object())


def test_worker_set_states_names_ranks_and_bundles():
    start_group = object()
    workers = WorkerSet([(started_worker("prefill-0", "prefill"), 0, BundleSlot(start_group, 0, False)),
                         (started_worker("decode-0", "decode"), 1, BundleSlot(start_group, 1, False))])
    added = workers.reserve("decode")
    assert (added.name, added.rank, added.state, added.slot) == ("decode-1", 2, WorkerState.STARTING, None)
    assert not workers.is_alive("decode-1") and "decode-1" not in workers.workers
    own = BundleSlot(object(), 0, True)
    workers.started("decode-1", started_worker("decode-1", "decode"), own)
    assert workers.is_alive("decode-1") and workers.owned_groups() == [own.group]
    workers.drain("decode-0")
    assert workers.is_alive("decode-0") and workers.names("decode", WorkerState.SERVING) == ["decode-1"]
    with pytest.raises(ValueError, match="from draining to serving"):
        workers.started("decode-0", started_worker("decode-0", "decode"), own)
    workers.stopped("decode-0")                           # its start-group bundle waits for the next decode worker
    assert workers.state("decode-0") is WorkerState.STOPPED and "decode-0" not in workers.workers
    assert workers.held_bundles() == ["prefill", "decode", "decode"] and workers.held_bundles(free=True) == ["decode"]
    again = workers.reserve("decode")
    assert (again.name, again.rank, again.slot) == ("decode-2", 3, BundleSlot(start_group, 1, False))
    workers.stopped("decode-2")                           # failed to start: the bundle is free again
    assert workers.reserve("prefill").slot is None        # no free prefill bundle: a group of its own
    assert workers.mark_lost("decode-1", "it died") and not workers.mark_lost("decode-1", "again")
    assert workers.failures() == {"decode-1": "it died"} and not workers.is_alive("decode-1")
    assert workers.lost_bundles() == [own] and workers.owned_groups() == [] and workers.lost_bundles() == []
    assert workers.states() == {"prefill-0": {"role": "prefill", "state": "serving"},
                                "decode-1": {"role": "decode", "state": "lost"},
                                "prefill-1": {"role": "prefill", "state": "starting"}}


def test_worker_bounds():
    WorkerBounds(1, 3, 2, None).check_start(2, 2)
    for fields, match in (({"min_prefill": 0}, "min_prefill"), ({"min_decode": 3, "max_decode": 2}, "max_decode")):
        with pytest.raises(ValueError, match=match):
            WorkerBounds(**fields)
    with pytest.raises(ValueError, match="outside the bounds"):
        WorkerBounds(max_decode=2).check_start(1, 3)
    assert WorkerBounds(1, 3, 2, None).of("replica") == (2, None)


def parse(*flags):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)))


def test_serve_flags_for_bounds_and_the_autoscaler():
    config = parse("--prefill-workers", "1", "--decode-workers", "2", "--max-prefill-workers", "2",
                   "--max-decode-workers", "4", "--min-decode-workers", "2", "--autoscale", "--ttft-slo-ms", "500",
                   "--autoscale-interval-s", "2")
    assert config.bounds == WorkerBounds(1, 2, 2, 4)
    assert (config.autoscale.ttft_slo_ms, config.autoscale.interval_s, config.autoscale.itl_slo_ms) == (500, 2, 100)
    replicas = parse("--replicas", "2", "--max-replicas", "3", "--autoscale")
    assert replicas.bounds.of("replica") == (1, 3) and replicas.autoscale is not None
    assert parse("--replicas", "2").autoscale is None
    for flags, match in (
            (["--max-decode-workers", "2"], "needs workers on Ray"),
            (["--replicas", "2", "--max-decode-workers", "3"], "does not apply"),
            (["--prefill-workers", "1", "--max-replicas", "3"], "does not apply"),
            (["--replicas", "2", "--autoscale"], "--autoscale needs --max-replicas"),
            (["--replicas", "2", "--ttft-slo-ms", "100"], "needs --autoscale"),
            (["--replicas", "3", "--max-replicas", "2"], "within --min-replicas"),
            (["--replicas", "2", "--min-replicas", "0"], "--min-replicas must be >= 1"),
            (["--replicas", "2", "--max-replicas", "3", "--autoscale", "--autoscale-decode-occupancy", "2"],
             "decode_occupancy"),
            (["--replicas", "2", "--drain-timeout-s", "0"], "--drain-timeout-s")):
        with pytest.raises(ValueError, match=match):
            parse(*flags)
