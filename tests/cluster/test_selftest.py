"""`tandem selftest`: the CPU subset in quick mode passes (or skips with a reason) and writes the documented
JSON; a check that raises is a FAIL with its traceback while the others still run; and the command parses
and runs without importing Ray (the first GPU machine has no Ray)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from cluster import cli
from cluster.cli import _add_command, build_parser
from cluster.selftest import checks as selftest_checks
from cluster.selftest.checks import Check, run_checks
from cluster.selftest.context import SelftestContext
from cluster.selftest.results import FAIL, PASS, SKIP, passed

TOP_KEYS = {"selftest", "date", "options", "header", "checks", "summary"}
HEADER_KEYS = {"torch", "device", "device_name", "cuda_capability", "triton", "triton_interpret", "dtypes"}
CHECK_KEYS = {"name", "status", "detail", "seconds", "metrics", "error", "traceback"}
CPU_CHECKS = {"kernels triton fp32", "kernels triton bf16", "kernel numba fp32", "greedy fp32", "greedy fp32 triton",
              "greedy bf16", "memory plan", "prefill", "decode b=1", "decode b=8", "decode b=64", "transfer gloo",
              "transfer grpc", "transfer nccl", "transfer ipc"}


def run_selftest(*argv: str) -> int:
    args = build_parser().parse_args(["selftest", *argv])
    return args.run(args)


def test_quick_cpu_selftest_passes_or_skips_with_reasons_and_writes_the_json(tmp_path, capsys):
    report_path = tmp_path / "selftest.json"
    rc = run_selftest("--device", "cpu", "--quick", "--json", str(report_path))
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert set(report) == TOP_KEYS
    assert HEADER_KEYS <= set(report["header"]) and report["header"]["device"] == "cpu"
    assert report["options"] == {"device": "cpu", "quick": True, "only": ""}
    checks = report["checks"]
    assert {c["name"] for c in checks} == CPU_CHECKS
    for check in checks:
        assert set(check) == CHECK_KEYS
        assert check["status"] in (PASS, SKIP), f"{check['name']}: {check['detail']}\n{check['traceback']}"
        assert check["detail"], f"{check['name']} says nothing"
    statuses = {c["name"]: c["status"] for c in checks}
    must_run = ["kernel numba fp32", "greedy fp32", "greedy bf16", "transfer gloo", "transfer grpc"]
    if not torch.cuda.is_available():  # conftest set TRITON_INTERPRET=1 before any kernel was imported
        must_run += ["kernels triton fp32", "greedy fp32 triton"]
    for name in must_run:
        assert statuses[name] == PASS, f"{name}: {statuses[name]}"  # what this machine has must run
    assert report["summary"] == {"passed": sum(c["status"] == PASS for c in checks), "failed": 0,
                                 "skipped": sum(c["status"] == SKIP for c in checks), "ok": True}
    assert rc == 0
    assert "torch" in out and "decode b=64" in out and out.rstrip().endswith(f"wrote {report_path}")


def test_a_check_that_raises_fails_with_its_traceback_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("kernel exploded")

    fake = [Check("broken", broken), Check("fine", lambda ctx: passed("all good", value=1.0))]
    results = run_checks(fake, SelftestContext(torch.device("cpu"), True, tmp_path))
    assert [(r.name, r.status) for r in results] == [("broken", FAIL), ("fine", PASS)]
    assert results[0].detail == results[0].error == "RuntimeError: kernel exploded"
    assert "in broken" in results[0].traceback and results[1].metrics == {"value": 1.0}

    monkeypatch.setattr(selftest_checks, "checks_for", lambda ctx: fake)
    report_path = tmp_path / "failed.json"
    assert run_selftest("--device", "cpu", "--json", str(report_path)) == 1
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"passed": 1, "failed": 1, "skipped": 0, "ok": False}
    assert "kernel exploded" in report["checks"][0]["traceback"]
    assert "FAILED: 1 passed, 1 failed, 0 skipped" in capsys.readouterr().out


def test_selftest_runs_without_importing_ray():
    """build_parser imports every subcommand's module: none may import Ray at module level, and the
    selftest itself never does. A command whose module cannot be imported stays, saying why when run. Given
    the command line, it imports only the named command's module: the HTTP load client starts without torch."""
    code = ("import sys\n"
            "from cluster.cli import build_parser, main\n"
            "build_parser(['bench', 'serve', '--base-url', 'http://127.0.0.1:1'])\n"
            "assert 'torch' not in sys.modules, 'building the parser of tandem bench serve imported torch'\n"
            "build_parser()\n"
            "assert 'ray' not in sys.modules, 'building the tandem parser imported ray'\n"
            "rc = main(['selftest', '--device', 'cpu', '--quick', '--only', 'kernel numba'])\n"
            "assert 'ray' not in sys.modules, 'the selftest imported ray'\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel numba fp32" in done.stdout and "\nOK: " in done.stdout


def test_a_command_whose_module_is_missing_says_so_when_run(monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="tandem")
    _add_command(parser.add_subparsers(dest="command"), "gone", "tandem_no_such_module", "help")
    monkeypatch.setattr(cli, "build_parser", lambda argv=None: parser)
    assert cli.main(["gone", "--any", "flags"]) == 2
    assert "tandem gone: unavailable on this machine: No module named" in capsys.readouterr().err
