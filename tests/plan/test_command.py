"""`tandem plan` end to end on the tiny checkpoint (a real profile on the quick grid, a table with every
deployment, the JSON), SLOs no deployment meets (exit 2, the closest shown), a bench serve result as the
workload, and bad input: exit 2 with a message naming what is wrong."""
from __future__ import annotations

import json

import pytest

from cluster.bench.serve_metrics import RequestResult, compute_metrics
from cluster.bench.serve_report import RunSettings, result_json
from cluster.cli import main

WORKLOAD = ["--request-rate", "20", "--random-input-len", "48", "--random-output-len", "8",
            "--random-range-ratio", "0.5", "--num-prompts", "40"]
TRANSFER = ["--transfer-gbps", "1", "--transfer-latency-ms", "0.5"]
DEPLOYMENTS = ("colocated-3", "disagg-1p2d", "disagg-2p1d")


def plan(*flags: str) -> int:
    return main(["plan", *flags])


@pytest.fixture(scope="module")
def profiled(tiny_checkpoint, tmp_path_factory):
    """One real `tandem plan` run on the tiny checkpoint: (exit code, its JSON, the saved profile's path)."""
    folder = tmp_path_factory.mktemp("plan")
    code = plan("--model", str(tiny_checkpoint("llama")), "--device", "cpu", "--workers", "3", "--cpu-threads", "1",
                "--profile-grid", "quick", "--kv-cache-memory-mib", "16", "--ttft-slo-ms", "2000",
                "--itl-slo-ms", "500", *WORKLOAD, *TRANSFER, "--save-profile", str(folder / "profile.json"),
                "--json", str(folder / "plan.json"))
    return code, json.loads((folder / "plan.json").read_text()), folder / "profile.json"


def test_plan_profiles_simulates_every_deployment_and_recommends_one(profiled):
    code, result, _ = profiled
    assert code == 0
    assert [d["name"] for d in result["deployments"]] == list(DEPLOYMENTS)
    assert result["meets_slos"] and result["recommendation"] in DEPLOYMENTS and result["closest"] is None
    best = max(d["goodput"] for d in result["deployments"] if d["slo_attainment"] >= 0.9)
    chosen = next(d for d in result["deployments"] if d["name"] == result["recommendation"])
    assert chosen["goodput"] >= best * 0.99
    for deployment in result["deployments"]:
        assert deployment["ttft_p99_ms"] >= deployment["ttft_p50_ms"] > 0
        assert deployment["itl_p99_ms"] >= deployment["itl_p50_ms"] > 0
        assert (deployment["mean_transfer_ms"] > 0) == deployment["disaggregated"]
    assert result["workload"]["num_requests"] == 40 and result["profile"]["steps"] > 0


def test_the_table_lists_every_deployment_and_unmeetable_slos_exit_2_naming_the_closest(profiled, capsys):
    _, _, profile = profiled
    capsys.readouterr()
    code = plan("--load-profile", str(profile), "--device", "cpu", "--workers", "3", "--cpu-threads", "1",
                "--ttft-slo-ms", "0.001", "--itl-slo-ms", "500", *WORKLOAD, *TRANSFER, "--json")
    out, err = capsys.readouterr()
    assert code == 2
    table = [line.split()[0] for line in err.splitlines() if line.startswith(("colocated-", "disagg-"))]
    assert [name.rstrip("*") for name in table] == list(DEPLOYMENTS)
    assert "no deployment meets the SLOs" in err and "the closest is" in err
    result = json.loads(out)
    assert not result["meets_slos"] and result["recommendation"] is None and result["closest"] in DEPLOYMENTS


def test_one_worker_has_only_colocated_1_and_moves_no_kv(profiled, capsys):
    _, _, profile = profiled
    code = plan("--load-profile", str(profile), "--device", "cpu", "--workers", "1", "--cpu-threads", "1",
                "--ttft-slo-ms", "2000", "--itl-slo-ms", "500", *WORKLOAD, "--json")
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and [d["name"] for d in result["deployments"]] == ["colocated-1"]
    assert result["recommendation"] == "colocated-1" and result["transfer"]["source"].startswith("none")


def test_a_bench_serve_result_is_a_workload(profiled, tmp_path, capsys):
    _, _, profile = profiled
    results = [RequestResult(True, 40, 0.1 * i, (0.1 * i + 0.05, 0.1 * i + 0.06), (1, 1)) for i in range(10)]
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(result_json(compute_metrics(results, 1.0), RunSettings(10.0, None, 1.0))))
    code = plan("--load-profile", str(profile), "--device", "cpu", "--workers", "2", "--cpu-threads", "1",
                "--workload-json", str(path), "--num-prompts", "20", "--ttft-slo-ms", "5000", "--itl-slo-ms", "500",
                *TRANSFER)
    out = capsys.readouterr().out
    assert code == 0
    assert "20 requests at 10 req/s" in out and "mean prompt 40, mean output 2" in out


def test_a_detailed_vllm_result_gives_every_requests_lengths(profiled, tmp_path, capsys):
    _, _, profile = profiled
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps({"completed": 3, "total_input_tokens": 90, "total_output_tokens": 12,
                                "request_rate": "inf", "input_lens": [10, 30, 50], "output_lens": [2, 4, 6]}))
    code = plan("--load-profile", str(profile), "--device", "cpu", "--workers", "2", "--cpu-threads", "1",
                "--workload-json", str(path), "--ttft-slo-ms", "5000", "--itl-slo-ms", "500", *TRANSFER, "--json")
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["workload"]["num_requests"] == 3 and result["workload"]["request_rate"] == "inf"


def test_calibrated_serving_costs_in_the_profile_slow_the_prediction_on_shared_cores(profiled, tmp_path, capsys):
    _, _, profile = profiled
    saved = json.loads(profile.read_text())
    costs = {"request_cpu_ms": 5.0, "token_cpu_ms": 2.0, "baseline_cores": 0.1, "request_overhead_ms": 3.0,
             "step_overhead_ms": 1.0}
    calibrated = tmp_path / "calibrated.json"
    calibrated.write_text(json.dumps({**saved, "serving": {"colocated": costs}}))
    runs = {}
    for path, cores in ((profile, "inf"), (calibrated, "1"), (calibrated, "inf")):
        plan("--load-profile", str(path), "--device", "cpu", "--workers", "3", "--cpu-threads", "1",
             "--host-cores", cores, "--ttft-slo-ms", "2000", "--itl-slo-ms", "500", *WORKLOAD, *TRANSFER, "--json")
        runs[path.name, cores] = json.loads(capsys.readouterr().out)
    shared = runs["calibrated.json", "1"]
    older_profile_defaults = {"step_cpu_ms": 0.0, "step_overhead_sigma": 0.0}  # keys a saved profile may lack
    assert shared["serving"]["colocated"] == {**costs, **older_profile_defaults, "calibrated": True}
    assert shared["host_cores"] == 1
    assert not shared["serving"]["disaggregated"]["calibrated"]
    colocated = {key: next(d for d in run["deployments"] if d["name"] == "colocated-3") for key, run in runs.items()}
    bare, slowed, unshared = colocated[profile.name, "inf"], colocated["calibrated.json", "1"], \
        colocated["calibrated.json", "inf"]
    # one core: 0.9 of it even for a worker alone; then the 1 ms per step
    assert slowed["tpot_p50_ms"] > unshared["tpot_p50_ms"] > bare["tpot_p50_ms"]
    assert unshared["ttft_p50_ms"] > bare["ttft_p50_ms"] + 3.0 - 1e-6


def test_tp_sizes_split_the_gpus_and_a_saved_profile_keeps_their_cost(profiled, tmp_path, capsys):
    """--gpus 4 with prefill TP=2 and replicas of TP=2: colocated-2-tp2 and disagg-1p2d-ptp2, each on 4 devices;
    the given --tp-cost is printed, in the JSON, and kept by --save-profile for a later --load-profile."""
    _, _, profile = profiled
    saved = tmp_path / "tp-profile.json"
    saved.write_text(json.dumps({**json.loads(profile.read_text()),
                                 "tp_costs": [{"tp": 2, "step_ms": 0.2, "token_us": 1.0, "source": "saved"}]}))
    common = ["--device", "cpu", "--gpus", "4", "--prefill-tp", "2", "--tp", "2", "--cpu-threads", "1",
              "--ttft-slo-ms", "2000", "--itl-slo-ms", "500", *WORKLOAD, *TRANSFER, "--json"]
    results = {}
    for name, flags in (("given", ["--load-profile", str(profile), "--tp-cost", "2:0.5:2"]),
                        ("loaded", ["--load-profile", str(saved)])):
        assert plan(*common, *flags) in (0, 2)
        out, err = capsys.readouterr()
        results[name] = json.loads(out)
        assert "budget: 4 devices" in err and "TP=2 step: compute / 2 +" in err
        assert "2P+2D=4" in err  # the disaggregated split's devices per role
    given, loaded = results["given"], results["loaded"]
    assert [d["name"] for d in given["deployments"]] == ["colocated-2-tp2", "disagg-1p2d-ptp2"]
    assert [(d["gpus"], d["prefill_gpus"], d["decode_gpus"]) for d in given["deployments"]] == [(4, 0, 4), (4, 2, 2)]
    assert given["devices"] == 4 and (given["prefill_tp"], given["decode_tp"], given["replica_tp"]) == (2, 1, 2)
    assert given["tp_costs"] == [{"tp": 2, "step_ms": pytest.approx(0.5), "token_us": pytest.approx(2.0),
                                  "source": "given: --tp-cost 2:0.5:2"}]
    assert loaded["tp_costs"][0]["source"] == "saved"


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "4", "--workers", "4", "--prefill-tp", "3"], "--prefill-tp 3 does not divide the budget of 4"),
    (["--request-rate", "4", "--gpus", "6", "--tp", "4"], "--tp 4 does not divide the budget of 6"),
    (["--request-rate", "4", "--gpus", "4", "--decode-tp", "0"], "--decode-tp must be an integer >= 1, got 0"),
    (["--request-rate", "4", "--gpus", "4", "--tp", "-2"], "--tp must be an integer >= 1, got -2"),
    (["--request-rate", "4", "--gpus", "4", "--prefill-tp", "2", "--decode-tp", "4"], "is more than the 4 devices"),
    (["--request-rate", "4", "--gpus", "4", "--tp-cost", "2:0.5"], "--tp-cost '2:0.5': give T:STEP_MS:TOKEN_US"),
    (["--request-rate", "4", "--gpus", "4", "--tp-cost", "2:0:0", "--tp-cost", "2:1:1"], "--tp-cost gives TP=2 twice"),
    (["--workload-json", "{tmp}/not.json"], "not JSON"),
    (["--workload-json", "{tmp}/compare.json"], "not a `tandem bench serve` result (no completed"),
    (["--workload-json", "{tmp}/missing.json"], "cannot read it"),
    (["--workload-json", "{tmp}/negative.json"], "completed must be >= 1"),
    (["--request-rate", "4", "--ttft-slo-ms", "-5"], "--ttft-slo-ms and --itl-slo-ms must be > 0"),
    (["--request-rate", "4", "--workers", "0"], "--workers must be >= 1"),
    (["--request-rate", "4", "--slo-attainment", "1.5"], "--slo-attainment must be in (0, 1]"),
    (["--request-rate", "4", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--request-rate", "-1"], "--request-rate and --burstiness must be positive"),
    ([], "--request-rate is required"),
    (["--request-rate", "4", "--load-profile", "{tmp}/compare.json"], "not a saved `tandem plan` profile"),
    (["--request-rate", "4", "--chunk-size", "0"], "--chunk-size"),
    (["--request-rate", "4", "--step-overhead-ms", "-1"], "--step-overhead-ms must be >= 0"),
    (["--request-rate", "4", "--transfer-gbps", "0"], "--transfer-gbps must be > 0"),
    (["--request-rate", "4", "--host-cores", "0"], "--host-cores must be > 0"),
])
def test_bad_input_exits_2_saying_what_is_wrong(flags, message, tmp_path, capsys):
    (tmp_path / "not.json").write_text("{ this is not json")
    (tmp_path / "compare.json").write_text(json.dumps({"flags": {}, "runs": []}))
    (tmp_path / "negative.json").write_text(json.dumps({"completed": 0, "total_input_tokens": 1,
                                                        "total_output_tokens": 1, "request_rate": 4}))
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    code = plan("--device", "cpu", "--ttft-slo-ms", "100", "--itl-slo-ms", "10", *flags)
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--dataset-name", "sharegpt"], "invalid choice: 'sharegpt'"),
    (["--profile-grid", "huge"], "invalid choice: 'huge'"),
    (["--host-scheduler", "cfs"], "invalid choice: 'cfs'"),
    (["--request-rate", "fast"], "invalid float value: 'fast'"),
    (["--itl-slo-ms", "10"], "the following arguments are required: --ttft-slo-ms"),
])
def test_unknown_flag_values_exit_2_from_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan("--device", "cpu", *flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
