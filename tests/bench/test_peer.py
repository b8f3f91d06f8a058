"""`tandem bench peer` against a stub OpenAI server started by the test (and, once, a real `tandem serve`):
every server and rate gets a row, Tandem's rows their ratios to the peer, and a peer that cannot run is reported
without figures."""
from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import peer
from cluster.bench.peer_report import PeerRun, format_markdown, round_ratios
from cluster.bench.serve_metrics import RequestResult, compute_metrics
from tests.support.stub_openai import StubOpenAIServer

SMALL = ("--model", "tiny", "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "4")


def run_bench(tmp_path, *flags: str) -> tuple[int, str, list[dict]]:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    code = peer.run(parser.parse_args([*SMALL, "--results-dir", str(tmp_path), *flags]))
    return code, (tmp_path / "results.md").read_text(), json.loads((tmp_path / "results.json").read_text())


def test_the_peer_alone_gets_a_row_per_rate_and_a_plot(tmp_path) -> None:
    with StubOpenAIServer() as stub:
        code, markdown, runs = run_bench(tmp_path, "--peer-url", stub.base_url, "--modes", "none",
                                         "--request-rates", "inf,20")
        assert stub.completions == 3 * 4  # the warm pass (other ids) and two measured rates
    assert code == 0
    assert [(r["server"], r["rate"]) for r in runs] == [("peer", float("inf")), ("peer", 20.0)]
    assert all(r["metrics"]["completed"] == 4 and r["metrics"]["total_output_tokens"] == 24 for r in runs)
    assert markdown.count("| peer |") == 2
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_a_tandem_mode_is_served_measured_and_compared_with_the_peer(tmp_path) -> None:
    with StubOpenAIServer() as stub:
        code, markdown, runs = run_bench(tmp_path, "--peer-url", stub.base_url, "--modes", "colocated",  # lazy pool:
                                         "--request-rates", "inf", "--serve-args=--device cpu --no-kv-cache-resident")
    assert code == 0
    assert [r["server"] for r in runs] == ["peer", "tandem colocated"]
    tandem = runs[1]["metrics"]
    assert tandem["completed"] == 4 and tandem["failed"] == 0 and tandem["total_output_tokens"] == 24
    tandem_row = next(line for line in markdown.splitlines() if line.startswith("| tandem colocated |"))
    assert tandem_row.count("x |") == 4  # TTFT, TPOT, ITL and throughput against the peer's
    assert (tmp_path / "server-colocated.log").exists()


def test_a_peer_whose_requests_all_fail_gets_no_figures(tmp_path) -> None:
    with StubOpenAIServer(fail_completions=True) as stub:
        code, markdown, runs = run_bench(tmp_path, "--peer-url", stub.base_url, "--modes", "none",
                                         "--request-rates", "inf")
    assert code == 0
    assert runs[0]["metrics"] is None
    assert "no figures: all 4 requests failed" in markdown and "HTTP 500" in markdown


def test_a_peer_that_does_not_answer_gets_no_figures(tmp_path) -> None:
    with StubOpenAIServer() as stub:
        url = stub.base_url  # closed when the block ends: nothing listens there any more
    code, markdown, runs = run_bench(tmp_path, "--peer-url", url, "--modes", "none", "--request-rates", "inf")
    assert code == 0 and runs[0]["metrics"] is None
    assert "does not answer" in markdown
    assert not (tmp_path / "peer.png").exists()


@pytest.mark.parametrize("flags, message", [
    (("--modes", "colocated-two"), "unknown mode"),
    (("--modes", "colocated,colocated"), "twice"),
    (("--modes", "none"), "nothing to run"),
    (("--peer-url", "http://127.0.0.1:9", "--request-rates", "0"), "positive"),
    (("--peer-url", "http://127.0.0.1:9", "--repeats", "0"), "--repeats"),
])
def test_bad_flags_are_refused_before_anything_starts(tmp_path, flags, message) -> None:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        peer.run(parser.parse_args([*SMALL, "--results-dir", str(tmp_path), *flags]))


def test_repeats_run_every_server_once_per_round_and_pair_the_ratios_within_a_round(tmp_path) -> None:
    with StubOpenAIServer() as stub:
        code, markdown, runs = run_bench(tmp_path, "--peer-url", stub.base_url, "--modes", "none",
                                         "--request-rates", "inf", "--repeats", "2")
        assert stub.completions == 2 * 2 * 4  # the warm pass and the measured rate, in each round
    assert code == 0
    assert [(r["server"], r["round"]) for r in runs] == [("peer", 0), ("peer", 1)]
    assert "| peer #1 |" in markdown and "| peer #2 |" in markdown


def _run(server: str, ttft: float, gap: float, round_: int) -> PeerRun:
    """Two requests sent at 0 whose first token comes after `ttft` s, then tokens every `gap` s."""
    results = [RequestResult(True, 8, 0.0, (ttft, ttft + gap, ttft + 2 * gap), (1, 1, 1)) for _ in range(2)]
    return PeerRun(server, 1.0, compute_metrics(results, duration=1.0), results, round=round_)


def test_rounds_are_summed_up_as_median_ratios_with_every_rounds_beside_them() -> None:
    """--repeats: a ratio pairs one round's runs; the summary gives each metric's median over the rounds and lists
    every round's, since one round on a drifting machine can be off by a factor of two."""
    rounds = [(0.100, 0.050, 0.110, 0.100), (0.200, 0.100, 0.110, 0.100), (0.100, 0.100, 0.120, 0.100)]
    runs = [run for index, (peer_ttft, peer_gap, ttft, gap) in enumerate(rounds)
            for run in (_run("vllm", peer_ttft, peer_gap, index), _run("tandem colocated", ttft, gap, index))]
    ((key, per_round),) = round_ratios(runs).items()
    assert key == ("tandem colocated", 1.0)
    assert [r[0] for r in per_round] == pytest.approx([1.1, 0.55, 1.2])  # TTFT
    assert [r[1] for r in per_round] == pytest.approx([2.0, 1.0, 1.0])  # TPOT
    markdown = format_markdown(runs)
    summary = next(line for line in markdown.splitlines() if line.startswith("| tandem colocated | 1 |"))
    assert "1.10x (1.10, 0.55, 1.20)" in summary and "1.00x (2.00, 1.00, 1.00)" in summary
    assert "| tandem colocated #3 | 1 |" in markdown  # each round's own row stays
    assert "Across rounds" not in format_markdown([r for r in runs if r.round == 0])  # one round: no summary
