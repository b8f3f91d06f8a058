"""`tandem selftest [--device auto|cpu|cuda] [--json PATH] [--quick] [--only PREFIXES]`.

Prints the header, one row per check as it finishes, then the table and a summary. Exit code 0 when no
check failed (skips are fine: each says why), 1 when one did, 2 when the device asked for is not here or
--only matches no check.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

DESCRIPTION = "Check this machine: kernels, greedy vs transformers, speed against its limits, KV transports."
KERNEL_MODULES = ("engine.attention.triton_decode", "engine.attention.triton_prefill",
                  "engine.attention.triton_store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda when a GPU is visible, else cpu (the CPU subset)")
    parser.add_argument("--json", default="", metavar="PATH", help="also write the report as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="smaller models and sizes (seconds on a CPU); the numbers are less telling")
    parser.add_argument("--only", default="", metavar="PREFIXES",
                        help="run only the checks whose names start with one of these (comma-separated), "
                             "e.g. 'kernels,greedy'")


def run(args: argparse.Namespace) -> int:
    from cluster.selftest.checks import checks_for, run_checks, select
    from cluster.selftest.context import SelftestContext
    from cluster.selftest.report import (collect_header, format_header, format_row, format_summary, format_table,
                                         summary, write_json)

    device = resolve_device(args.device)
    if device is None:
        print("tandem selftest: --device cuda, but no CUDA GPU is visible", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tandem-selftest-") as workdir:
        ctx = SelftestContext(device, args.quick, Path(workdir))
        ctx.notes += prepare_triton(device)
        header = collect_header(ctx)
        print(format_header(header), flush=True)
        checks = select(checks_for(ctx), args.only)
        if not checks:
            print(f"tandem selftest: no check's name starts with {args.only!r}", file=sys.stderr)
            return 2
        results = []  # filled as checks finish, so an interrupted run still writes its JSON
        options = {"device": args.device, "quick": args.quick, "only": args.only}
        try:
            with _progress(len(checks)) as bar:
                def show(result):
                    results.append(result)
                    bar.write(format_row(result))
                    bar.update(1)
                run_checks(checks, ctx, on_result=show)
        finally:
            ctx.release_perf()
            if args.json:
                write_json(args.json, header, results, options)
    print("\n" + format_table(results) + "\n" + format_summary(results), flush=True)
    if args.json:
        print(f"wrote {args.json}")
    return 0 if summary(results)["ok"] else 1


def resolve_device(requested: str) -> torch.device | None:
    """The device to check: None when cuda is asked for and there is none."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        return None
    return torch.device(requested)


def prepare_triton(device: torch.device) -> list[str]:
    """On CPU, Triton's kernels run only in its interpreter, which is read when a kernel module is imported:
    set TRITON_INTERPRET=1 now unless the user set it. Returns notes for the report."""
    if device.type != "cpu":
        return []
    if "TRITON_INTERPRET" in os.environ:
        return [f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} was set before the selftest"]
    os.environ["TRITON_INTERPRET"] = "1"
    note = "TRITON_INTERPRET=1 set by the selftest: on CPU the Triton kernels run in Triton's interpreter"
    if any(name in sys.modules for name in KERNEL_MODULES):
        note += " (too late for kernel modules already imported in this process)"
    return [note]


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="selftest", unit="check", leave=False, disable=None)
