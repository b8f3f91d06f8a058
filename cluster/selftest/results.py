"""What a check returns (Outcome) and what the report keeps of it (CheckResult)."""
from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Outcome:
    """A check's verdict: status, one line of measured numbers (or the skip reason), and the numbers."""

    status: str
    detail: str
    metrics: dict = field(default_factory=dict)


def passed(detail: str, **metrics) -> Outcome:
    return Outcome(PASS, detail, metrics)


def failed(detail: str, **metrics) -> Outcome:
    return Outcome(FAIL, detail, metrics)


def skipped(reason: str) -> Outcome:
    return Outcome(SKIP, reason)


def verdict(ok: bool, detail: str, **metrics) -> Outcome:
    return Outcome(PASS if ok else FAIL, detail, metrics)


@dataclass(frozen=True)
class CheckResult:
    """One row of the report. error and traceback are set when the check raised."""

    name: str
    status: str
    detail: str
    seconds: float
    metrics: dict = field(default_factory=dict)
    error: str = ""
    traceback: str = ""
