"""`--dataset-name multiturn`: the conversations, a real `tandem serve` chatted with turn by turn (each prompt
the chat so far, answers as streamed), the report's KV bytes per turn after the first, and `bench compare`'s
reuse-on vs reuse-off verdict on hand-made runs."""
from __future__ import annotations

import json
import subprocess

import pytest

from cluster.bench.compare_modes import ModeSettings, parse_modes, serving_mode
from cluster.bench.compare_report import ModeRun, format_markdown
from cluster.bench.serve_metrics import RequestResult, compute_metrics
from cluster.bench.serve_multiturn import MultiturnSummary
from cluster.bench.serve_workloads import MultiturnWorkload, generate_conversations, validate_workload
from tests.support.serve_process import TANDEM


def test_conversations_have_4_to_8_turns_and_are_reproducible():
    workload = MultiturnWorkload(first_len=100, user_len=20, output_len=16)
    chats = generate_conversations(workload, 50, 256, seed=3)
    assert {len(c.messages) for c in chats} <= set(range(4, 9)) and len({len(c.messages) for c in chats}) > 2
    assert all(len(c.messages[0]) == 100 and all(len(m) == 20 for m in c.messages[1:]) for c in chats)
    assert chats == generate_conversations(workload, 50, 256, seed=3) != generate_conversations(workload, 50, 256, 4)
    assert chats[0].max_tokens == 100 + 20 * (len(chats[0].messages) - 1) + 16 * len(chats[0].messages)
    for bad in (MultiturnWorkload(0, 20, 16), MultiturnWorkload(10, 20, 16, min_turns=5, max_turns=4)):
        with pytest.raises(ValueError, match="multiturn"):
            validate_workload(bad, 256)


def test_bench_serve_chats_turn_by_turn_with_the_answers_it_streamed(tmp_path, default_server_port):
    result_file = tmp_path / "multiturn.json"
    done = subprocess.run([*TANDEM, "bench", "serve", "--base-url", f"http://127.0.0.1:{default_server_port}",
                           "--dataset-name", "multiturn", "--num-prompts", "3", "--multiturn-first-len", "40",
                           "--multiturn-user-len", "8", "--multiturn-min-turns", "3", "--multiturn-max-turns", "3",
                           "--random-output-len", "6", "--ignore-eos", "--result-json", str(result_file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Multi-turn" in done.stdout and "Mean KV bytes per turn after the first:" in done.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 9 and result["failed"] == 0
    # turn 2: 40 + 6 answered + 8 = 54 tokens, turn 3: 54 + 6 + 8 = 68; the input total counts every turn
    assert result["total_input_tokens"] == 3 * (40 + 54 + 68)
    multiturn = result["multiturn"]
    assert (multiturn["conversations"], multiturn["first_turns"], multiturn["later_turns"]) == (3, 3, 6)
    assert multiturn["later_prompt_tokens"] == 61 and multiturn["later_kv_bytes"] == 0   # colocated: nothing moves


def turn(index: int, prompt_len: int, kv_bytes: int, cached: int = 0, location: str = "remote") -> RequestResult:
    timing = {"kv_bytes": kv_bytes, "decode_cached_tokens": cached, "prefill_location": location}
    return RequestResult(True, prompt_len, 0.0, (0.1, 0.2), (1, 1), "", timing, (5, 6), turn=index)


def test_compare_reports_later_turn_bytes_against_the_noreuse_twin():
    assert parse_modes("disagg-1p1d,disagg-1p1d-noreuse") == ["disagg-1p1d", "disagg-1p1d-noreuse"]
    settings = ModeSettings(None, "auto", "cpu", "auto", max_model_len=2048, chunk_size=128, kv_cache_memory_mib=64,
                            cpu_cores=4)
    assert "--no-decode-prefix-reuse" in serving_mode("disagg-1p1d-local64-noreuse", settings).serve_flags
    assert "--no-decode-prefix-reuse" not in serving_mode("disagg-1p1d", settings).serve_flags
    reuse = [turn(1, 512, 1 << 20), turn(2, 700, 100_000, cached=640), turn(3, 900, 200_000, cached=832),
             turn(2, 600, 0, cached=592, location="local")]
    whole = [turn(1, 512, 1 << 20), turn(2, 700, 1_500_000), turn(3, 900, 1_800_000), turn(2, 600, 1_200_000)]
    summary = MultiturnSummary.of(reuse)
    assert (summary.conversations, summary.later_turns, summary.later_local) == (1, 3, 1)
    assert summary.later_kv_bytes == pytest.approx(100_000) and summary.later_cached_tokens == pytest.approx(688)
    runs = [ModeRun(mode, 2.0, compute_metrics(results, 1.0), results, True)
            for mode, results in (("disagg-1p1d", reuse), ("disagg-1p1d-noreuse", whole))]
    markdown = format_markdown(runs)
    assert "| disagg-1p1d | 2 | 1 | 3 | 733.3 | 100000 | 688.0 | 1 |" in markdown
    assert "disagg-1p1d: KV bytes per turn after the first 100000 = 6.7% of the whole prompt's" in markdown
    assert "goal <= 25%: met" in markdown
    assert MultiturnSummary.of([RequestResult(True, 10)]) is None   # not a multiturn run: no section
    assert "KV bytes per turn after the first" not in format_markdown(
        [ModeRun("disagg-1p1d", 2.0, compute_metrics([], 1.0), [RequestResult(True, 10)], True)])
