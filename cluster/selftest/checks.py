"""Which checks run on this device, in order, and the runner that turns each into a CheckResult.

Every check is a function of the SelftestContext returning an Outcome (PASS / FAIL / SKIP with a reason).
The runner times it, catches whatever it raises (FAIL with the error, and the last frames of the traceback
for the JSON) and frees device memory after it, so one broken check never stops the ones after it.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from cluster.selftest import greedy, kernels, perf, transfer
from cluster.selftest.context import SelftestContext, free_device_memory
from cluster.selftest.results import FAIL, CheckResult, Outcome

TRACEBACK_FRAMES = 8


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[SelftestContext], Outcome]


def checks_for(ctx: SelftestContext) -> list[Check]:
    """Kernels, greedy agreement, memory plan, prefill, decode at each batch, then each transport."""
    checks = [Check("kernels triton fp32", partial(kernels.check_triton, dtype=torch.float32)),
              Check("kernels triton bf16", partial(kernels.check_triton, dtype=torch.bfloat16)),
              Check("kernel numba fp32", kernels.check_cpu_kernel)]
    checks += [Check(case.name, partial(greedy.check_greedy, case=case)) for case in greedy.cases_for(ctx.cuda)]
    checks += [Check("memory plan", perf.check_memory_plan), Check("prefill", perf.check_prefill)]
    checks += [Check(f"decode b={batch}", partial(perf.check_decode, batch=batch))
               for batch in ctx.sizes.decode_batches]
    checks += [Check(f"transfer {name}", partial(transfer.check_transfer, transport=name))
               for name in transfer.TRANSPORTS]
    return checks


def select(checks: list[Check], only: str) -> list[Check]:
    """The checks whose name starts with one of the comma-separated prefixes in `only` (all when empty)."""
    prefixes = [p.strip() for p in only.split(",") if p.strip()]
    return [c for c in checks if not prefixes or any(c.name.startswith(p) for p in prefixes)]


def run_check(check: Check, ctx: SelftestContext) -> CheckResult:
    started = time.perf_counter()
    try:
        outcome = check.run(ctx)
    except (Exception, SystemExit) as exc:  # SystemExit too: an argparse error inside a check ends only the check
        error = f"{type(exc).__name__}: {exc}"
        return CheckResult(check.name, FAIL, error, time.perf_counter() - started, error=error,
                           traceback=traceback.format_exc(limit=-TRACEBACK_FRAMES))
    finally:
        free_device_memory()
    return CheckResult(check.name, outcome.status, outcome.detail, time.perf_counter() - started,
                       dict(outcome.metrics))


def run_checks(checks: Iterable[Check], ctx: SelftestContext,
               on_result: Callable[[CheckResult], None] = lambda result: None) -> list[CheckResult]:
    results = []
    for check in checks:
        results.append(run_check(check, ctx))
        on_result(results[-1])
    return results
