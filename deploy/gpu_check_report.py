"""The Markdown report of `make gpu-check` (deploy/gpu_check.sh): the card and versions, every step's command,
exit status and time, then the numbers each step wrote (selftest checks, engine bench, memory bench, KV transfer,
the 1P1D serving smoke test, the suite's summary). A step whose output is missing says so.

    python deploy/gpu_check_report.py OUT > OUT/report.md
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(out: Path) -> str:
    sections = [_header(out), _steps(out), _selftest(out), _engine(out), _engine(out, eager=True), _memory(out),
                _transfer(out), _serving(out), _suite(out)]
    return "\n\n".join(section for section in sections if section) + "\n"


def _json(out: Path, name: str):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def _header(out: Path) -> str:
    env = (out / "env.txt").read_text().strip() if (out / "env.txt").exists() else "(env.txt missing)"
    return "## GPU check\n\n```\n" + env + "\n```"


def _steps(out: Path) -> str:
    rows = ["| step | exit | seconds | command |", "|---|---|---|---|"]
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, command = (line.split("\t", 3) + ["", "", ""])[:4]
        rows.append(f"| {name} | {_exit(rc)} | {seconds} | `{_cell(command)}` |")
    return "\n".join(rows)


def _exit(rc: str) -> str:
    return {"0": "ok", "124": "timed out"}.get(rc, rc)


def _selftest(out: Path) -> str:
    report = _json(out, "selftest.json")
    if report is None:
        return "### selftest\n\nno selftest.json"
    rows = ["### selftest", "", "| check | status | detail |", "|---|---|---|"]
    rows += [f"| {c['name']} | {c['status']} | {_cell(c.get('detail', ''))} |" for c in report.get("checks", [])]
    return "\n".join(rows)


def _engine(out: Path, eager: bool = False) -> str:
    """bench engine's limits table (eager: the bench-engine-eager step's, prefill and mixed steps without graphs;
    nothing when that step did not run)."""
    name = "bench_engine_eager.json" if eager else "bench_engine.json"
    title = "### bench engine (qwen2.5-0.5b shape, bfloat16" + (", prefill and mixed steps eager)" if eager else ")")
    bench = _json(out, name)
    if bench is None:
        return "" if eager else f"{title}\n\nno {name}"
    rows = [title, "",
            f"{bench['engine_tok_s']:,.0f} useful tok/s over {bench['num_requests']} requests", "",
            "| phase | batch | engine ms | host ms | device ms | floor ms | engine / floor | floor |",
            "|---|---|---|---|---|---|---|---|"]
    for limit in bench.get("limits", []):
        ratio = limit["engine_ms"] / limit["floor_ms"] if limit.get("floor_ms") else float("nan")
        rows.append(f"| {limit['phase']} | {limit['batch']} | {limit['engine_ms']:.2f} | "
                    f"{_number(limit.get('host_ms'))} | {_number(limit.get('device_ms'))} | {limit['floor_ms']:.2f} "
                    f"| {ratio:.1f}x | {limit['floor']} |")
    return "\n".join(rows + _step_profiles(bench.get("step_profiles", [])))


def _step_profiles(profiles: list[dict]) -> list[str]:
    """bench engine --profile-steps: per step, the kernels, their device time and the heaviest of them."""
    rows = []
    for profile in profiles:
        calls = ", ".join(f"{name} {count:g}" for name, count in sorted(profile.get("runtime", {}).items()))
        rows += ["", f"**{profile['phase']}**, per step: {profile['kernels']:g} kernels, {profile['busy_ms']:.3f} ms "
                     f"on the device" + (f"; {calls}" if calls else ""), "",
                 "| ms | count | kernel |", "|---|---|---|"]
        rows += [f"| {ms:.3f} | {count:g} | `{_cell(name[:100])}` |" for name, count, ms in profile["top"]]
        if profile.get("wall_ms") is not None:  # the host's side: wall per step, then cProfile's heaviest functions
            rows += ["", f"host: {profile['wall_ms']:.3f} ms wall per step; Python's heaviest own times:", "",
                     "| ms | calls | function |", "|---|---|---|"]
            rows += [f"| {ms:.3f} | {count:g} | `{_cell(name[:100])}` |"
                     for name, count, ms in profile.get("python", [])]
    return rows


def _memory(out: Path) -> str:
    memory = _json(out, "memory.json")
    if memory is None:
        return "### bench memory\n\nno memory.json"
    keys = ("shape", "dtype", "decodes", "long_prompt", "kv_blocks", "peak_allocated_gib", "device_total_gib",
            "decode_step_ms_before", "slowest_step_ms_during", "long_prompt_ttft_s", "preemptions", "out_of_memory")
    rows = ["### bench memory", "", "| what | value |", "|---|---|"]
    rows += [f"| {key} | {_number(memory.get(key))} |" for key in keys]
    return "\n".join(rows + ["", f"memory plan: {memory.get('memory_plan', '')}"])


def _transfer(out: Path) -> str:
    result = _json(out, "transfer.json")
    title = "### KV transfer (ipc, two processes, one card)"
    if result is None:
        return f"{title}\n\nno transfer.json"
    rows = [title, "", "| size MiB | ms | GB/s | raw socket GB/s | bit exact |", "|---|---|---|---|---|"]
    rows += [f"| {r['size_bytes'] / 2**20:g} | {r['seconds'] * 1e3:.2f} | {r['gbps']:.2f} | {r['baseline_gbps']:.2f} "
             f"| {r['bit_exact']} |" for r in result["rows"]]
    cost = result.get("cost")
    if cost:
        rows += ["", f"fixed cost {cost['fixed_ms']:.3f} ms per transfer, then {cost['per_byte_gbps']:.2f} GB/s "
                     f"(raw socket: {cost['raw_fixed_ms']:.3f} ms, {cost['raw_per_byte_gbps']:.2f} GB/s)"]
    return "\n".join(rows)


def _serving(out: Path) -> str:
    result = _json(out, "bench_serve.json")
    title = "### 1P1D serving smoke test (one card, mixed dataset)"
    if result is None:
        return f"{title}\n\nno bench_serve.json"
    disagg = result.get("disagg", {})
    pairs = [("completed / failed", f"{result['completed']} / {result['failed']}"),
             ("output tok/s", _number(result.get("output_throughput"))),
             ("TTFT median / p99 ms", _pair(result, "ttft")),
             ("TPOT median / p99 ms", _pair(result, "tpot")),
             ("ITL median / p99 ms", _pair(result, "itl")),
             ("KV transfer p50 ms", _number(disagg.get("transfer_ms_p50"))),
             ("transfer share of TTFT p50", _number(disagg.get("transfer_share_of_ttft_p50")))]
    first = _json(out, "first_requests.json")
    if first:
        ttfts = first["ttft_ms"]
        pairs.append((f"TTFT of the first {len(ttfts)} requests, one at a time ({first['prompt_tokens']} tokens), ms",
                      " / ".join(f"{ttft:.1f}" for ttft in ttfts) + f" (first / last {first['first_over_tenth']:.2f})"))
        if "client_first_use_ms" in first:  # paid before them, on a throwaway server of the client's own
            pairs.append(("the client's own first request (not to Tandem), ms", _number(first["client_first_use_ms"])))
        for which in ("first", "last"):  # where the server says each went (tandem_timing)
            phases = first.get(f"phases_{which}") or {}
            if phases:
                pairs.append((f"the {which} one's tandem_timing, ms",
                              ", ".join(f"{name.removesuffix('_ms')} {ms:.1f}" for name, ms in phases.items())))
    smoke = (out / "serve-1p1d.log").read_text().strip() if (out / "serve-1p1d.log").exists() else ""
    rows = [title, "", "| what | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in pairs]
    return "\n".join(rows + ([f"\n{smoke.splitlines()[-1]}"] if smoke else []))


def _suite(out: Path) -> str:
    path = out / "pytest.log"
    if not path.exists():
        return "### suite\n\nno pytest.log"
    lines = path.read_text(errors="replace").splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "no summary")
    # -rfE's summary, or, for a run cut by its timeout, the -v lines of the tests that had failed by then
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))] or sorted(
        {f"{match[1]} {match[2]}" for match in (re.search(r"\b(FAILED|ERROR) (tests/\S+)", line) for line in lines)
         if match})
    return "\n".join(["### suite (tests/engine tests/kv_transfer)", "", f"`{summary.strip('= ')}`", *failures])


def _pair(result: dict, metric: str) -> str:
    return f"{_number(result.get(f'median_{metric}_ms'))} / {_number(result.get(f'p99_{metric}_ms'))}"


def _cell(text: str) -> str:
    """Text that stays in its Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.stdout.write(main(Path(sys.argv[1])))
