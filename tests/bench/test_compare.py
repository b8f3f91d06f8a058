"""`tandem bench compare`: mode flags, the ratio and goal arithmetic on hand-made runs, and one real
end-to-end run over two modes (real `tandem serve` subprocesses, a local Ray for the disaggregated one)."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from cluster import cli
from cluster.bench.compare import _mode_names, add_arguments, parse_rates
from cluster.bench.compare_modes import ModeSettings, default_mode_names, default_workers, parse_modes, serving_mode
from cluster.bench.compare_report import (ModeRun, devices_line, format_markdown, goal_baseline, goal_lines, ratio_rows,
                                          runs_json)
from cluster.bench.serve_metrics import RequestResult, compute_metrics
from tests.support.serve_process import TANDEM

SETTINGS = ModeSettings("tiny", "auto", "cpu", "auto", max_model_len=1088, chunk_size=128,
                        kv_cache_memory_mib=64, cpu_cores=4)


def test_modes_become_the_serve_flags_that_make_them():
    colocated = serving_mode("colocated", SETTINGS).serve_flags
    assert ("--no-enable-chunked-prefill" in colocated
            and colocated[colocated.index("--max-num-batched-tokens") + 1] == "1088")
    chunked = serving_mode("colocated-chunked", SETTINGS).serve_flags
    assert "--enable-chunked-prefill" in chunked and chunked[chunked.index("--max-num-batched-tokens") + 1] == "128"
    disagg = serving_mode("disagg-1p3d", SETTINGS)
    flags = disagg.serve_flags
    assert disagg.is_disaggregated and flags[flags.index("--prefill-workers") + 1] == "1"
    assert flags[flags.index("--decode-workers") + 1] == "3" and flags[flags.index("--cpu-threads") + 1] == "1"
    assert flags[flags.index("--kv-cache-memory-mib") + 1] == "64"
    assert flags[flags.index("--local-prefill-tokens") + 1] == "0"
    local = serving_mode("disagg-1p1d-local300", SETTINGS).serve_flags
    assert local[local.index("--local-prefill-tokens") + 1] == "300"
    replicas = serving_mode("colocated-2", SETTINGS)
    flags = replicas.serve_flags
    assert not replicas.is_disaggregated and flags[flags.index("--replicas") + 1] == "2"
    assert flags[flags.index("--cpu-threads") + 1] == "2" and "--enable-chunked-prefill" in flags
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "128"


def test_every_mode_says_what_hardware_it_got():
    assert serving_mode("colocated-2", SETTINGS).hardware == "2 workers x 2 threads"
    assert serving_mode("disagg-1p1d", SETTINGS).hardware == "2 workers x 2 threads"
    assert serving_mode("disagg-1p3d", SETTINGS).hardware == "4 workers x 1 thread"
    assert serving_mode("colocated", SETTINGS).hardware == "in-process engine, 4 threads"
    gpus = lambda n: dataclasses.replace(SETTINGS, num_gpus=n)  # noqa: E731
    assert serving_mode("colocated-4", gpus(4)).hardware == "4 GPUs, 1 per worker"
    shared = serving_mode("disagg-1p1d", gpus(1))
    assert shared.hardware == "1 GPU shared by 2 workers" and "--gpus-per-worker" in shared.serve_flags
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        serving_mode("disagg-2p2d", gpus(2))


def test_mode_and_rate_lists_are_validated():
    assert parse_modes("colocated, disagg-2p1d,disagg-1p1d-local64") == ["colocated", "disagg-2p1d",
                                                                         "disagg-1p1d-local64"]
    assert parse_modes("colocated-4,colocated-chunked") == ["colocated-4", "colocated-chunked"]
    for bad in ("", "colocated,colocated", "disagg-0p1d", "disaggregated", "disagg-1p1d-local", "colocated-0",
                "colocated-x"):
        with pytest.raises(ValueError):
            parse_modes(bad)
    assert parse_rates("2, inf") == [2.0, float("inf")]
    for bad in ("", "0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert default_mode_names(2) == ["colocated-2", "disagg-1p1d"]
    assert default_mode_names(4) == ["colocated-4", "disagg-1p3d", "disagg-2p2d", "disagg-3p1d"]
    with pytest.raises(ValueError, match="--workers must be >= 2"):
        default_mode_names(1)
    assert (default_workers(0, 2), default_workers(0, 8), default_workers(2, 64), default_workers(4, 2)) == (2, 4, 2, 4)


def test_tp_modes_serve_tp_groups_and_count_their_gpus():
    """A mode's TP sizes become `tandem serve`'s --tp / --prefill-tp / --decode-tp; its devices are P x A + D x B
    (one GPU or one CPU thread share per rank)."""
    assert parse_modes("colocated-2-tp2,disagg-1p2d-ptp2,disagg-1p1d-ptp2-dtp2-local64,disagg-2p1d-dtp2-noreuse") \
        == ["colocated-2-tp2", "disagg-1p2d-ptp2", "disagg-1p1d-ptp2-dtp2-local64", "disagg-2p1d-dtp2-noreuse"]
    for bad in ("colocated-2-tp0", "disagg-1p1d-ptp0", "disagg-1p1d-dtp2-ptp2", "colocated-tp2"):
        with pytest.raises(ValueError):
            parse_modes(bad)
    replicas = serving_mode("colocated-2-tp2", SETTINGS)
    flags = replicas.serve_flags
    assert flags[flags.index("--replicas") + 1] == "2" and flags[flags.index("--tp") + 1] == "2"
    assert replicas.devices == 4 and flags[flags.index("--cpu-threads") + 1] == "1"
    assert replicas.hardware == "4 ranks x 1 thread: 2 replicas x TP2"
    split = serving_mode("disagg-1p2d-ptp2-local64", SETTINGS)
    flags = split.serve_flags
    assert flags[flags.index("--prefill-tp") + 1] == "2" and "--decode-tp" not in flags and "--tp" not in flags
    assert flags[flags.index("--local-prefill-tokens") + 1] == "64" and split.devices == 4
    assert serving_mode("disagg-1p1d", SETTINGS).devices == 2 and serving_mode("colocated", SETTINGS).devices == 0
    gpus = lambda n: dataclasses.replace(SETTINGS, num_gpus=n)  # noqa: E731
    wide = serving_mode("disagg-1p1d-ptp2-dtp2", gpus(4))
    assert wide.hardware == "4 GPUs, 1 per rank: 1 prefill x TP2 + 1 decode x TP2" and wide.devices == 4
    with pytest.raises(ValueError, match=r"needs 4 GPUs \(one per rank\)"):
        serving_mode("colocated-2-tp2", gpus(1))  # a TP group takes whole GPUs: no shared one


def _compare_args(*flags: str):
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_tp_sizes_make_an_equal_gpu_set_of_modes_and_bad_ones_name_the_flag():
    assert default_mode_names(4, 2, 1, 2) == ["colocated-2-tp2", "disagg-1p2d-ptp2"]
    assert default_mode_names(8, 2, 2, 2) == ["colocated-4-tp2", "disagg-1p3d-ptp2-dtp2", "disagg-2p2d-ptp2-dtp2",
                                              "disagg-3p1d-ptp2-dtp2"]
    assert _mode_names(_compare_args("--gpus", "4", "--prefill-tp", "2", "--tp", "2"), 0) == \
        ["colocated-2-tp2", "disagg-1p2d-ptp2"]
    for flags, message in ((["--gpus", "4", "--prefill-tp", "3"], "--prefill-tp 3 does not divide the budget of 4"),
                           (["--workers", "4", "--decode-tp", "0"], "--decode-tp must be an integer >= 1, got 0"),
                           (["--gpus", "4", "--tp", "-1"], "--tp must be an integer >= 1, got -1"),
                           (["--gpus", "6", "--prefill-tp", "2", "--decode-tp", "3"], "uses every device"),
                           (["--modes", "colocated-2", "--tp", "2"], "--tp: with --modes the TP sizes go in the mode")):
        with pytest.raises(ValueError, match=message):
            _mode_names(_compare_args(*flags), 0)


def test_the_report_says_how_many_gpus_each_mode_used():
    equal = [_run("colocated-2", 0.1, 0.1), _run("disagg-1p1d", 0.1, 0.05)]
    assert devices_line(equal) == "GPUs: every Ray mode used 2 (GPUs, one per rank; on CPU rank shares)."
    unequal = equal + [dataclasses.replace(_run("disagg-1p2d-ptp2", 0.1, 0.05), devices=4)]
    assert "NOT equal hardware" in devices_line(unequal) and "disagg-1p2d-ptp2 4" in devices_line(unequal)
    markdown = format_markdown(unequal)
    assert "| disagg-1p2d-ptp2 | 2 workers x 1 thread | 4 | 4 |" in markdown and "NOT equal hardware" in markdown
    assert [run["gpus"] for run in runs_json(unequal, {})["runs"]] == [2, 2, 4]
    assert goal_baseline([_run("colocated-2-tp2", 0.1, 0.1), _run("disagg-1p2d-ptp2", 0.1, 0.05)]) == \
        "colocated-2-tp2"


def _run(mode: str, ttft: float, gap: float) -> ModeRun:
    """Two requests sent at 0 whose first token comes after `ttft` s, then tokens every `gap` s."""
    results = [RequestResult(True, 8, 0.0, (ttft, ttft + gap, ttft + 2 * gap), (1, 1, 1),
                             timing={"queue_ms": 1.0, "prefill_ms": 2.0, "transfer_ms": 3.0 if "disagg" in mode else 0})
               for _ in range(2)]
    return ModeRun(mode, 4.0, compute_metrics(results, duration=1.0), results, True, "2 workers x 1 thread",
                   devices=0 if mode in ("colocated", "colocated-chunked") else 2)


def test_ratios_and_the_goal_verdict():
    runs = [_run("colocated", ttft=0.100, gap=0.200), _run("colocated-chunked", ttft=0.100, gap=0.050),
            _run("disagg-1p1d", ttft=0.120, gap=0.080)]
    rows = {(mode, base): (itl, ttft, tput) for _, mode, base, itl, ttft, tput in ratio_rows(runs)}
    assert rows[("disagg-1p1d", "colocated")][:2] == pytest.approx((0.4, 1.2))
    assert rows[("disagg-1p1d", "colocated-chunked")][:2] == pytest.approx((1.6, 1.2))
    (line,) = goal_lines(runs)
    assert "p99 ITL 0.40x" in line and "median TTFT 1.20x" in line and "NOT met" not in line
    slower = [runs[0], _run("disagg-1p1d", ttft=0.200, gap=0.150)]
    assert goal_lines(slower)[0].count("NOT met") == 2
    markdown = format_markdown(runs, "tandem bench compare")
    assert markdown.count("\n| colocated") == 2
    assert "\n| disagg-1p1d | 2 workers x 1 thread | 2 | 4 | 2 / 0 |" in markdown
    assert "| 3.0 / 3.0 |" in markdown
    document = runs_json(runs, {"burstiness": 1.0})
    assert [run["mode"] for run in document["runs"]] == ["colocated", "colocated-chunked", "disagg-1p1d"]
    assert document["runs"][2]["p99_itl_ms"] == pytest.approx(80.0)
    assert document["runs"][0]["hardware"] == "2 workers x 1 thread"
    equal = [_run("colocated-2", ttft=0.100, gap=0.100), _run("disagg-1p1d", ttft=0.120, gap=0.040)]
    assert goal_baseline(equal) == "colocated-2" and goal_baseline(runs) == "colocated"
    (line,) = goal_lines(equal)
    assert "disagg-1p1d vs colocated-2: p99 ITL 0.40x" in line and "Goal (disaggregated vs colocated-2" in \
        format_markdown(equal)


def test_compare_runs_each_mode_end_to_end(tmp_path):
    results = tmp_path / "results"
    done = subprocess.run([*TANDEM, "bench", "compare", "--workers", "2", "--request-rates", "inf",
                           "--num-prompts", "4", "--num-warmups", "1", "--mixed-long-fraction", "0.25",
                           "--mixed-long-len", "80", "--mixed-short-len", "12", "--random-output-len", "4",
                           "--kv-cache-memory-mib", "16", "--model", "tiny", "--results-dir", str(results)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((results / "results.json").read_text())
    by_mode = {run["mode"]: run for run in document["runs"]}
    assert set(by_mode) == {"colocated-2", "disagg-1p1d"}            # equal hardware: 2 Ray workers each
    for run in by_mode.values():
        assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 16
        assert run["pool_whole"] is True and run["hardware"].startswith("2 workers x ")
    assert by_mode["disagg-1p1d"]["disagg"]["transfer_ms_p50"] > 0
    assert by_mode["colocated-2"]["disagg"]["transfer_ms_p50"] == 0
    for name in ("results.md", "ttft_cdf.png", "itl_cdf.png", "ttft_breakdown.png",
                 "server-colocated-2.log", "server-disagg-1p1d.log"):
        assert (results / name).stat().st_size > 0, name
    assert "replicas on Ray" in (results / "server-colocated-2.log").read_text()
    assert "| inf | 4 / 0 |" in (results / "results.md").read_text()


def test_compare_rejects_bad_flags_before_starting_anything(tmp_path, capsys):
    """The CLI's own entry point (cluster.cli.main, what `tandem` runs), in this process: a fresh interpreter per
    call only added its start-up (~3 s each); the end-to-end test above runs the command as a subprocess."""
    assert cli.main(["bench", "compare", "--modes", "colocated,warp", "--results-dir", str(tmp_path)]) == 2
    assert "unknown mode 'warp'" in capsys.readouterr().err
    assert cli.main(["bench", "compare", "--repeats", "0", "--results-dir", str(tmp_path)]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was started: no server log, no result


def test_rounds_pair_within_a_round_and_the_verdict_takes_their_median():
    """--repeats: ratios pair the runs of one round, never across rounds; the goal is judged on the median
    of the rounds' ratios, each listed; the table names each run's round."""
    rounds = [(0.100, 0.100, 0.110, 0.030), (0.100, 0.100, 0.150, 0.060), (0.100, 0.100, 0.130, 0.040)]
    runs = [dataclasses.replace(run, repeat=index)
            for index, (base_ttft, base_gap, ttft, gap) in enumerate(rounds)
            for run in (_run("colocated-2", base_ttft, base_gap), _run("disagg-1p1d", ttft, gap))]
    assert len(ratio_rows(runs)) == 3  # one pair per round, not 3 x 3
    (line,) = goal_lines(runs)
    assert "median TTFT 1.30x (goal <= 1.25: NOT met)" in line and "p99 ITL 0.40x (goal <= 0.5: met)" in line
    assert "medians of 3 rounds (p99 ITL 0.30x, 0.60x, 0.40x; median TTFT 1.10x, 1.50x, 1.30x)" in line
    markdown = format_markdown(runs)
    assert "\n| disagg-1p1d #3 | " in markdown and "median TTFT ratio (median of 3 rounds)" in markdown
    assert "| 4 | disagg-1p1d | colocated-2 | 0.40x | 1.30x |" in markdown
    (ratio,) = runs_json(runs, {})["ratios"]
    assert ratio["median_ttft_ratio"] == pytest.approx(1.3)
    assert ratio["rounds"]["median_ttft_ratio"] == pytest.approx([1.1, 1.5, 1.3])
