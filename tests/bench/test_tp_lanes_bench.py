"""`tandem bench tp-lanes` runs end to end on the embedded model: a prefill group of 2 ranks and a one-rank decode
engine, the hand-off through rank 0 and by lanes (merged) side by side, their ratio, and no follower left once it
returns."""
from __future__ import annotations

import multiprocessing
import re

from cluster.cli import main


def test_bench_tp_lanes_reports_both_ways_and_their_ratio(capsys):
    assert main(["bench", "tp-lanes", "--model", "tiny", "--decode-tp", "1", "--prefill-tokens", "40",
                 "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"TP=2 -> TP=1 over gloo, 40-token prompts \([\d.]+ MiB of KV\)", out)
    rank0 = float(re.search(r"through rank 0 +([\d.]+) ms", out).group(1))
    lanes = float(re.search(r"by lanes +([\d.]+) ms", out).group(1))
    ratio = float(re.search(r"lanes / rank 0: ([\d.]+)x", out).group(1))
    assert rank0 > 0 and lanes > 0 and abs(lanes / rank0 - ratio) <= 0.01 + 0.05 * ratio
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("tandem-tp-rank")]


def test_bench_tp_lanes_refuses_a_group_of_one(capsys):
    assert main(["bench", "tp-lanes", "--model", "tiny", "--tp", "1"]) == 2
    assert "one group needs >= 2 ranks" in capsys.readouterr().err
