"""`tandem bench serve --fault kill-decode@50%`: a decode worker of the served cluster dies part way.

Before the run the client reads the server's /health, which lists its workers with their process ids,
and picks the first decode worker. Once the given share of the requests has been sent it SIGKILLs that
worker's process (the server must run on this machine: the process is checked to be a ray::DecodeActor
before anything is signalled). After the run it reports how many requests migrated (their
`tandem_timing.migrations`), the longest gap between tokens that migrated and other requests saw
(p50 / p99), and the failed requests: what a client pays for a worker death.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import urllib.request
from dataclasses import dataclass

from cluster.bench.serve_metrics import RequestResult, percentile

FAULT_KINDS = ("kill-decode",)


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    at_fraction: float   # of the requests sent when the fault fires

    @classmethod
    def parse(cls, spec: str) -> "FaultSpec":
        """'kill-decode@50%' -> FaultSpec('kill-decode', 0.5); ValueError names what is wrong."""
        match = re.fullmatch(r"([a-z-]+)@(\d+(?:\.\d+)?)%", spec)
        if not match or match.group(1) not in FAULT_KINDS or not 0 < float(match.group(2)) < 100:
            raise ValueError(f"--fault must be one of {FAULT_KINDS} followed by @P% with 0 < P < 100, "
                             f"e.g. kill-decode@50%; got {spec!r}")
        return cls(match.group(1), float(match.group(2)) / 100)


class FaultInjector:
    """Fires the fault once `on_sent` has been told that its share of `num_requests` went out."""

    def __init__(self, spec: FaultSpec, base_url: str, num_requests: int) -> None:
        self.spec = spec
        self.threshold = max(1, math.ceil(num_requests * spec.at_fraction))
        self.victim, self.pid = _local_decode_worker(base_url)
        self.fired_after: int | None = None

    def on_sent(self, sent: int) -> None:
        if sent == self.threshold and self.fired_after is None:
            os.kill(self.pid, signal.SIGKILL)
            self.fired_after = sent


def _local_decode_worker(base_url: str) -> tuple[str, int]:
    with urllib.request.urlopen(f"{base_url}/health", timeout=30) as response:
        health = json.loads(response.read())
    decode = sorted((name, info) for name, info in (health.get("workers") or {}).items()
                    if info.get("role") == "decode" and info.get("pid"))
    if not decode:
        raise ValueError("--fault kill-decode needs a disaggregated server: its /health lists no decode worker")
    name, info = decode[0]
    try:
        with open(f"/proc/{info['pid']}/cmdline", "rb") as cmdline:
            is_decode_actor = b"DecodeActor" in cmdline.read()
    except OSError:
        is_decode_actor = False
    if not is_decode_actor:
        raise ValueError(f"--fault kill-decode: {name}'s process {info['pid']} is not a ray::DecodeActor on this "
                         f"machine (the server must run here)")
    return name, int(info["pid"])


@dataclass(frozen=True)
class FaultReport:
    kind: str
    victim: str
    fired_after_requests: int | None
    migrated: int
    failed: int
    migrated_max_gap_ms: tuple[float, float]   # p50, p99 of each migrated request's longest gap
    other_max_gap_ms: tuple[float, float]      # the same for the requests that did not move


def fault_report(injector: FaultInjector, results: list[RequestResult]) -> FaultReport:
    done = [r for r in results if r.success]
    moved = [r for r in done if (r.timing or {}).get("migrations", 0) > 0]
    stayed = [r for r in done if (r.timing or {}).get("migrations", 0) == 0]

    def gaps(group: list[RequestResult]) -> tuple[float, float]:
        longest = [max(r.itls, default=0.0) * 1e3 for r in group]
        return (percentile(longest, 50), percentile(longest, 99)) if longest else (0.0, 0.0)

    return FaultReport(injector.spec.kind, injector.victim, injector.fired_after, len(moved),
                       len(results) - len(done), gaps(moved), gaps(stayed))


def format_fault(report: FaultReport) -> str:
    when = "never fired" if report.fired_after_requests is None else \
        f"after {report.fired_after_requests} requests were sent"
    return "\n".join([
        f"{' Fault ':=^50}",
        f"{'Fault:':<40}{report.kind} {report.victim}, {when}",
        f"{'Requests migrated:':<40}{report.migrated}",
        f"{'Failed requests:':<40}{report.failed}",
        f"{'Longest token gap, migrated (p50/p99):':<40}{report.migrated_max_gap_ms[0]:.1f} / "
        f"{report.migrated_max_gap_ms[1]:.1f} ms",
        f"{'Longest token gap, others (p50/p99):':<40}{report.other_max_gap_ms[0]:.1f} / "
        f"{report.other_max_gap_ms[1]:.1f} ms",
        "=" * 50])


