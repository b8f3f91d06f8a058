"""The report: a header (versions, device, dtype), one row per check, a summary line, and the JSON.

JSON (`--json PATH`): {"selftest": 1, "date", "options": {"device", "quick", "only"}, "header": {...},
"checks": [{"name", "status", "detail", "seconds", "metrics", "error", "traceback"}],
"summary": {"passed", "failed", "skipped", "ok"}}.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from cluster.selftest.results import FAIL, PASS, SKIP, CheckResult

NAME_WIDTH = 20


def collect_header(ctx) -> dict:
    """What the machine is. Every field is read on its own: one that fails says so and the rest stay."""
    header = {}
    for key, read in _HEADER_FIELDS:
        try:
            header[key] = read(ctx)
        except Exception as exc:  # a header field must never stop the selftest
            header[key] = f"unknown ({type(exc).__name__}: {exc})"
    return header


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def _device_name(ctx) -> str:
    if ctx.cuda:
        return torch.cuda.get_device_name(ctx.device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _capability(ctx) -> str:
    if not ctx.cuda:
        return "n/a (CPU)"
    major, minor = torch.cuda.get_device_capability(ctx.device)
    props = torch.cuda.get_device_properties(ctx.device)
    return f"sm_{major}{minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"


_HEADER_FIELDS = (
    ("python", lambda ctx: platform.python_version()),
    ("torch", lambda ctx: f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
    ("device", lambda ctx: str(ctx.device)),
    ("device_name", _device_name),
    ("cuda_capability", _capability),
    ("gpus", lambda ctx: torch.cuda.device_count() if torch.cuda.is_available() else 0),
    ("cpu_threads", lambda ctx: f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs"),
    ("dtypes", lambda ctx: f"float32 and bfloat16 (perf checks: {ctx.perf_dtype})"),
    ("triton", lambda ctx: _version("triton")),
    ("triton_interpret", lambda ctx: os.environ.get("TRITON_INTERPRET", "unset")),
    ("transformers", lambda ctx: _version("transformers")),
    ("numba", lambda ctx: _version("numba")),
    ("grpcio", lambda ctx: _version("grpc")),
    ("mode", lambda ctx: "quick" if ctx.quick else "full"),
    ("notes", lambda ctx: list(ctx.notes)),
)


def format_header(header: dict) -> str:
    lines = ["tandem selftest"]
    for key, value in header.items():
        if key == "notes":
            lines += [f"  note: {note}" for note in value]
        else:
            lines.append(f"  {key:<17} {value}")
    return "\n".join(lines)


def format_row(result: CheckResult) -> str:
    return f"{result.name:<{NAME_WIDTH}} {result.status:<4} {result.seconds:6.1f}s  {result.detail}"


def format_table(results: list[CheckResult]) -> str:
    head = f"{'check':<{NAME_WIDTH}} {'':<4} {'time':>7}  result"
    return "\n".join([head, "-" * len(head), *(format_row(r) for r in results)])


def summary(results: list[CheckResult]) -> dict:
    counts = {status: sum(1 for r in results if r.status == status) for status in (PASS, FAIL, SKIP)}
    return {"passed": counts[PASS], "failed": counts[FAIL], "skipped": counts[SKIP], "ok": counts[FAIL] == 0}


def format_summary(results: list[CheckResult]) -> str:
    s = summary(results)
    verdict = "OK" if s["ok"] else "FAILED"
    return f"{verdict}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped"


def report_json(header: dict, results: list[CheckResult], options: dict) -> dict:
    return {"selftest": 1, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "options": options, "header": header, "checks": [asdict(r) for r in results],
            "summary": summary(results)}


def write_json(path: str | Path, header: dict, results: list[CheckResult], options: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_json(header, results, options), indent=1, default=str) + "\n")
