"""`tandem bench load`: fresh processes load a model and answer one token; the table covers every stage."""
from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import load


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    load.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_two_fresh_processes_each_report_every_stage(tmp_path, capsys) -> None:
    out = tmp_path / "load.json"
    assert load.run(parse("--model", "tiny", "--device", "cpu", "--runs", "2", "--kv-cache-memory", str(1 << 22),
                          "--json", str(out))) == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2
    for report in runs:
        assert set(report["seconds"]) == set(load.STAGES)
        assert all(seconds > 0 for seconds in report["seconds"].values())
        assert report["device"] == "cpu" and isinstance(report["text"], str)
    printed = capsys.readouterr().out
    for row in (*load.STAGES, *load.TOTALS):
        assert row in printed


def test_a_process_that_fails_to_load_reports_the_error() -> None:
    with pytest.raises(RuntimeError, match="no-such-model"):
        load.run(parse("--model", "/no-such-model", "--device", "cpu", "--runs", "1"))


def test_zero_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="--runs"):
        load.run(parse("--runs", "0"))
