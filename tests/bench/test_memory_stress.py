"""`tandem bench memory` on CPU with the tiny shape: the workload runs to the end, and a pool too small for
all of it preempts instead of failing."""
from __future__ import annotations

import argparse
import json

from cluster.bench import memory_stress


def run_bench(tmp_path, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    memory_stress.add_arguments(parser)
    out = tmp_path / "memory.json"
    code = memory_stress.run(parser.parse_args(["--device", "cpu", "--decodes", "16", "--long-prompt", "1024",
                                                "--max-tokens", "24", "--json", str(out), *flags]))
    result = json.loads(out.read_text())
    assert code == 0, result
    return result


def test_decodes_and_a_long_prompt_all_finish(tmp_path):
    result = run_bench(tmp_path)
    assert result["finished"] == 17 and result["out_of_memory"] is None
    assert result["decode_step_ms_before"] > 0 and result["long_prompt_ttft_s"] > 0


def test_a_small_pool_preempts_and_still_finishes_everything(tmp_path):
    result = run_bench(tmp_path, "--kv-cache-mib", "1", "--max-num-batched-tokens", "256")
    assert result["kv_blocks"] == 128
    assert result["finished"] == 17 and result["preemptions"] > 0
