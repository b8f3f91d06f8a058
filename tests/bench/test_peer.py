"""`tandem bench peer` against a stub OpenAI server started by the test (and, once, a real `tandem serve`):
every server and rate gets a row, Tandem's rows their ratios to the peer, and a peer that cannot run is reported
without figures."""
from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import peer
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
        code, markdown, runs = run_bench(tmp_path, "--peer-url", stub.base_url, "--modes", "colocated",
                                         "--request-rates", "inf", "--serve-args=--device cpu")
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
