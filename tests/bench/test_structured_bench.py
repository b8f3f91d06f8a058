"""`tandem bench structured` runs end to end on the embedded model and reports the step ratio, the mask fill
and the new-vs-cached TTFT it exists for."""
from __future__ import annotations

import re

from cluster.cli import main


def test_bench_structured_reports_its_ratios(capsys):
    assert main(["bench", "structured", "--model", "tiny", "--batch", "4", "--max-tokens", "10", "--rounds", "1",
                 "--ttft-repeats", "1"]) == 0
    out = capsys.readouterr().out
    ratio = re.search(r"all rows constrained [\d.]+ ms, ratio ([\d.]+)", out)
    assert ratio and float(ratio.group(1)) > 0
    assert re.search(r"mask fill of 4 rows .*: [\d.]+ ms; applying it to the logits [\d.]+ ms", out)
    assert re.search(r"TTFT of a new schema [\d.]+ ms vs cached [\d.]+ ms, ratio [\d.]+", out)
