"""`tandem bench tp` runs end to end on the embedded model: both engines side by side, the table and the verdict
against issue 29's 2x bound, the KV hand-off's gather and scatter through rank 0, and no follower left once it
returns."""
from __future__ import annotations

import multiprocessing
import re

from cluster.cli import main


def test_bench_tp_reports_step_ratios(capsys):
    assert main(["bench", "tp", "--model", "tiny", "--threads", "2", "--batch", "2", "--context", "20",
                 "--steps", "3", "--prefill-tokens", "40", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(decode|prefill) \(.*?\) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.]+)x$", out,
                      re.MULTILINE)
    assert [r[0] for r in rows] == ["decode", "prefill"]
    for _, base, shared, gloo, shared_ratio, gloo_ratio in rows:
        for ms, ratio in ((shared, shared_ratio), (gloo, gloo_ratio)):
            assert float(base) > 0 and abs(float(ms) / float(base) - float(ratio)) <= 0.05 * float(ratio)
    handoff = re.search(r"^KV hand-off \(([\d.]+) MiB\) +([\d.]+) +([\d.]+) +([\d.]+) +[\d.]+x +[\d.]+x", out,
                        re.MULTILINE)
    assert handoff and float(handoff.group(1)) > 0 and all(float(ms) > 0 for ms in handoff.groups()[1:])
    for label in ("TP=2", "TP=2 gloo"):
        assert re.search(label + r" costs at most [\d.]+x a TP=1 step: (within|OVER) issue 29's bound of 2x", out)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("tandem-tp-rank")]
