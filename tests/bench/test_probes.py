"""`tandem bench probes` (cluster/bench/probes.py) against real front ends (HTTP and gRPC over a tiny engine, as
`tandem serve` runs them): every probe is polled in both phases and said the server serves, each kind of large
request got its proper answer, the report and JSON say so; an unreachable server is exit 1 with the reason. No
timing is asserted (the numbers are the benchmark's, docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from cluster.api.input_pool import InputPool
from cluster.bench import probes
from engine import LLM
from tests.support.http_rig import KV_BYTES, front_ends

LOAD = probes.ProbeLoad(large_requests=5, prompt_bytes=300_000, baseline_s=0.2, rounds=2)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def test_every_probe_is_timed_in_both_phases_and_each_large_request_answered(engine):
    async def scenario():
        async with front_ends(engine, InputPool()) as fronts:
            return await probes.measure(fronts.base_url, fronts.grpc_target, LOAD)

    rounds = asyncio.run(scenario())
    assert len(rounds) == LOAD.rounds
    result = probes.summary(rounds)
    names = set(probes.HTTP_PROBES) | {"tandem.v1 Health", "grpc.health.v1"}
    for phase in ("idle", "loaded"):
        assert set(result[phase]) == names
        assert all(entry["answers"] >= LOAD.rounds and entry["failures"] == 0 for entry in result[phase].values())
    statuses = {kind: entry["statuses"] for kind, entry in result["large"].items()}
    assert statuses == {"completions": {"400": 4}, "chat": {"400": 2}, "tokenize": {"200": 2},
                        "gRPC Generate": {"INVALID_ARGUMENT": 2}}  # 5 a round, in turn: past the context
    report = probes.format_report(result, LOAD)
    assert all(name in report for name in names) and "worst probe under load" in report


def test_the_command_writes_its_json_and_an_unreachable_server_is_exit_1(engine, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    probes.add_arguments(parser)
    out = tmp_path / "probes.json"

    async def scenario():
        async with front_ends(engine, InputPool()) as fronts:
            args = parser.parse_args(["--base-url", fronts.base_url, "--large-requests", "1", "--prompt-mb", "0.1",
                                      "--baseline-s", "0.1", "--rounds", "1", "--json", str(out)])
            return await asyncio.to_thread(probes.run, args)

    assert asyncio.run(scenario()) == 0
    written = json.loads(out.read_text())
    assert set(written["loaded"]) == set(probes.HTTP_PROBES) and written["large"]["completions"]["statuses"]
    unreachable = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--rounds", "1"])
    assert probes.run(unreachable) == 1
    assert "cannot reach a Tandem/OpenAI server at http://127.0.0.1:9" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--large-requests"):
        probes.run(parser.parse_args(["--base-url", "http://127.0.0.1:9", "--large-requests", "0"]))
