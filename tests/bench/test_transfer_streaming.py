"""`tandem bench transfer --streaming`: bad input exits 2 before anything starts; the table's arithmetic."""
from __future__ import annotations

import pytest

from cluster.bench.transfer_streaming import ModeResult, _print_table
from cluster.cli import main


@pytest.mark.parametrize("flags", [["--transport", "nccl"], ["--transport", "ipc"], ["--prompt-lens", "0"],
                                   ["--prompt-lens", ","], ["--repeats", "0"]])
def test_bad_streaming_flags_exit_2(flags, capsys):
    assert main(["bench", "transfer", "--streaming", *flags]) == 2
    assert "tandem: error:" in capsys.readouterr().err


def test_the_table_reports_the_hidden_share_of_the_whole_transfer(capsys):
    rows = [ModeResult("request", 1024, 20.0, 20.0, 300.0, 330.0, 6 << 20),
            ModeResult("layer", 1024, 310.0, 4.0, 305.0, 312.0, 6 << 20)]
    _print_table(rows, type("Args", (), {"transport": "gloo", "shape": "llama-25m", "repeats": 3})())
    line = [row for row in capsys.readouterr().out.splitlines() if row.strip().startswith("1024")][0]
    assert "80%" in line and "0.95" in line  # 1 - 4/20 hidden; TTFT 312/330
