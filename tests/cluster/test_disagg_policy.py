"""The disaggregation policies as pure functions of a snapshot (cluster/coordinator/disagg_policy.py), the
throughput they measure, the decision in Timing and /metrics, and `--disagg-policy` at the command line."""
from __future__ import annotations

import argparse

import pytest

from cluster.api.metrics import ServingMetrics
from cluster.backend import BackendHealth, Timing
from cluster.coordinator.disagg_policy import (LOCAL, REMOTE, DecisionSnapshot, DisaggPolicy, PrefillPlacer,
                                               PrefillQueue, ThroughputMeter, decide, local_below_uncached_tokens)
from cluster.serve import add_arguments, config_from_args
from cluster.workers.cluster_config import ClusterConfig

IDLE = PrefillQueue(queued_tokens=0, prefill_tokens_per_s=1000.0)
BUSY = PrefillQueue(queued_tokens=3000, prefill_tokens_per_s=1000.0)  # a 3 s wait


def snapshot(prompt: int, cached: int = 0, load: PrefillQueue = IDLE) -> DecisionSnapshot:
    return DecisionSnapshot(prompt, cached, load)


@pytest.mark.parametrize("policy, case, expected", [
    # length: the prompt's length alone, cached or not, busy or not
    ("length", snapshot(99), LOCAL),
    ("length", snapshot(100), REMOTE),
    ("length", snapshot(2000, cached=1990), REMOTE),
    ("length", snapshot(500, load=BUSY), REMOTE),
    # uncached (llm-d): what the decode worker lacks
    ("uncached", snapshot(99), LOCAL),
    ("uncached", snapshot(100), REMOTE),
    ("uncached", snapshot(2000, cached=1904), LOCAL),     # a chat turn: 96 new tokens
    ("uncached", snapshot(2000, cached=1888), REMOTE),    # 112 new tokens
    ("uncached", snapshot(500, load=BUSY), REMOTE),       # load does not count
    # uncached_or_load: that, or a local prefill cheaper than the queue's wait
    ("uncached_or_load", snapshot(2000, cached=1904), LOCAL),
    ("uncached_or_load", snapshot(500, load=IDLE), REMOTE),
    ("uncached_or_load", snapshot(2999, load=BUSY), LOCAL),   # 2.999 s locally < the 3 s wait
    ("uncached_or_load", snapshot(3000, load=BUSY), REMOTE),  # 3 s: not less than the wait
    ("uncached_or_load", snapshot(3500, cached=512, load=BUSY), LOCAL),  # 2988 uncached tokens
    ("uncached_or_load", snapshot(500, load=PrefillQueue(3000, 1000.0, local_tokens_per_s=100.0)), REMOTE),
    ("uncached_or_load", snapshot(299, load=PrefillQueue(3000, 1000.0, local_tokens_per_s=100.0)), LOCAL),
    ("uncached_or_load", snapshot(500, load=PrefillQueue(3000, None)), REMOTE),  # wait not measured yet
])
def test_each_policy_decides_from_the_snapshot_alone(policy, case, expected):
    assert decide(DisaggPolicy(policy, threshold_tokens=100), case) == expected


def test_without_a_threshold_only_the_load_rule_prefills_locally():
    for name in ("length", "uncached"):
        assert decide(DisaggPolicy(name), snapshot(1, load=BUSY)) == REMOTE
    assert decide(DisaggPolicy("uncached_or_load"), snapshot(10, load=BUSY)) == LOCAL
    assert local_below_uncached_tokens(DisaggPolicy("uncached_or_load"), IDLE) == 0
    assert local_below_uncached_tokens(DisaggPolicy("uncached_or_load"), BUSY) == 3000
    assert local_below_uncached_tokens(DisaggPolicy("length", 100), BUSY) == 0   # decided before any match


def test_bad_policies_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="disagg_policy must be one of"):
        DisaggPolicy("fastest")
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        DisaggPolicy("uncached", -1)
    with pytest.raises(ValueError, match="disagg_policy must be one of"):
        ClusterConfig(disagg_policy="always")
    with pytest.raises(ValueError, match="kv_overlap_weight"):
        ClusterConfig(kv_overlap_weight=-1.0)


def test_the_meters_average_measured_prefills_and_the_placer_records_the_decision():
    meter = ThroughputMeter()
    meter.observe(10, 0.001)                    # too short to say anything
    assert meter.tokens_per_s is None
    meter.observe(1000, 1.0)
    meter.observe(2000, 1.0)
    assert meter.tokens_per_s == pytest.approx(0.8 * 1000 + 0.2 * 2000)
    placer = PrefillPlacer(DisaggPolicy("uncached_or_load", 50))
    assert placer.local_bound(10_000) == 50     # nothing measured: the wait is unknown
    placer.observe_remote(1000, 500.0)          # 2000 tokens/s on the prefill workers
    assert placer.local_bound(10_000) == 10_000  # a 5 s wait; local prefills taken as fast until measured
    timing = placer.decided(Timing(prefill_ms=1000.0), True, cached_tokens=64, prompt_tokens=564)
    assert (timing.prefill_location, timing.decode_cached_tokens) == (LOCAL, 64)
    assert placer.local_bound(10_000) == 2500   # local: 500 tokens/s measured from that request
    assert placer.decided(Timing(), False, 0, 10).prefill_location == REMOTE


def test_metrics_count_the_decisions_and_the_tokens_the_decode_workers_held():
    metrics = ServingMetrics()
    for location, cached in ((REMOTE, 0), (REMOTE, 32), (LOCAL, 48), ("", 0)):
        metrics.observe_finished(Timing(prefill_location=location, decode_cached_tokens=cached), 0.1)
    text = metrics.render(BackendHealth(True, "m", 1, 1)).decode()
    assert 'tandem_prefill_decisions_total{location="remote"} 2.0' in text
    assert 'tandem_prefill_decisions_total{location="local"} 1.0' in text
    assert "tandem_decode_cached_prompt_tokens_total 80.0" in text


def test_serve_flags_take_the_policy_and_refuse_an_unknown_one(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--prefill-workers", "1", "--disagg-policy", "uncached_or_load",
                                                 "--local-prefill-tokens", "64", "--no-decode-prefix-reuse"]))
    assert (config.disagg_policy, config.local_prefill_tokens, config.decode_prefix_reuse) == \
        ("uncached_or_load", 64, False)
    assert config_from_args(parser.parse_args(["--prefill-workers", "1"])).disagg_policy == "uncached"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--prefill-workers", "1", "--disagg-policy", "sometimes"])
    assert exit_info.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="need --mode disaggregated"):
        config_from_args(parser.parse_args(["--disagg-policy", "length"]))
