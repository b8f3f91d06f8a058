"""`tandem bench probes`: how fast a running server's probes answer while large requests arrive (issue 32: within
100 ms while 8 requests of 3.9 MB arrive at once, on 2 cores).

    tandem serve --port 8000 --grpc-port 50051 &
    tandem bench probes --base-url http://127.0.0.1:8000 --grpc-target 127.0.0.1:50051

Each round polls the probes back to back (HTTP /health, /ping, /version, /metrics; with --grpc-target also
tandem.v1 Health and grpc.health.v1 Check; each must say the server serves) for --baseline-s with nothing else
arriving, then sends --large-requests requests of --prompt-mb MB at once (completions, chat, /tokenize and, with
--grpc-target, gRPC Generate, in turn) and keeps polling until every one is answered. The report gives each probe's
p50 / p99 / max in both phases and each kind of large request's answers and slowest time. The client runs in its
own process: run the server in another.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Awaitable, Callable

import aiohttp

from cluster.bench.serve_client import ServerUnreachable, served_model
from cluster.bench.serve_metrics import percentile

HTTP_PROBES = ("/health", "/ping", "/version", "/metrics")
TARGET_MS = 100.0  # the bound on a probe under load


@dataclasses.dataclass(frozen=True)
class ProbeLoad:
    """What one run sends: `rounds` of (baseline_s of probes alone, then large_requests at once)."""

    large_requests: int = 8
    prompt_bytes: int = 3_900_000
    baseline_s: float = 1.0
    rounds: int = 3
    timeout_s: float = 300.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.large_requests < 1 or self.prompt_bytes < 3 or self.rounds < 1 or self.baseline_s <= 0:
            raise ValueError("--large-requests and --rounds must be >= 1, --prompt-mb and --baseline-s > 0")


@dataclasses.dataclass
class Samples:
    """Per probe: every answer's latency (s) and how many failed (an error, or not serving)."""

    latencies: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    failures: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, name: str, seconds: float, ok: bool) -> None:
        self.latencies.setdefault(name, []).append(seconds)
        if not ok:
            self.failures[name] = self.failures.get(name, 0) + 1


class Prober:
    """The probes of one server, polled back to back (one in flight at a time, as a load balancer's would be)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, grpc_channel=None):
        self.session, self.base_url = session, base_url
        self.checks = [(path, self._http(path)) for path in HTTP_PROBES]
        if grpc_channel is not None:
            self.checks += _grpc_checks(grpc_channel)

    def _http(self, path: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            async with self.session.get(self.base_url + path) as response:
                await response.read()
                return response.status == 200
        return check

    async def poll(self, until: asyncio.Event) -> Samples:
        """Every probe in turn until `until` is set (at least once each)."""
        samples = Samples()
        while True:
            for name, check in self.checks:
                start = time.perf_counter()
                try:
                    ok = await check()
                except Exception:  # noqa: BLE001 - a probe that fails is counted, not raised
                    ok = False
                samples.add(name, time.perf_counter() - start, ok)
            if until.is_set():
                return samples
            await asyncio.sleep(0.005)


def _grpc_checks(channel) -> list[tuple[str, Callable[[], Awaitable[bool]]]]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from proto import tandem_pb2, tandem_pb2_grpc
    tandem, standard = tandem_pb2_grpc.TandemStub(channel), health_pb2_grpc.HealthStub(channel)

    async def tandem_health() -> bool:
        return (await tandem.Health(tandem_pb2.HealthRequest())).status == "SERVING"

    async def standard_health() -> bool:
        serving = health_pb2.HealthCheckResponse.SERVING
        return (await standard.Check(health_pb2.HealthCheckRequest())).status == serving

    return [("tandem.v1 Health", tandem_health), ("grpc.health.v1", standard_health)]


def large_senders(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, grpc_channel=None,
                  api_key: str | None = None) -> list[tuple[str, Callable[[], Awaitable[str]]]]:
    """(kind, send) for each kind of large request; send() returns its answer's status ("400", "OK", ...)."""
    bodies = {"completions": ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2}),
              "chat": ("/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                "messages": [{"role": "user", "content": prompt}]}),
              "tokenize": ("/tokenize", {"model": model, "prompt": prompt})}
    senders = []
    for kind, (path, body) in bodies.items():
        data = json.dumps(body).encode()

        async def send(path=path, data=data) -> str:
            async with session.post(base_url + path, data=data, headers={"Content-Type": "application/json"}) as response:
                await response.read()
                return str(response.status)
        senders.append((kind, send))
    if grpc_channel is not None:
        senders.append(("gRPC Generate", _grpc_generate(grpc_channel, prompt, api_key)))
    return senders


def _grpc_generate(channel, prompt: str, api_key: str | None) -> Callable[[], Awaitable[str]]:
    import grpc

    from proto import tandem_pb2, tandem_pb2_grpc
    stub, metadata = tandem_pb2_grpc.TandemStub(channel), (("x-api-key", api_key),) if api_key else None

    async def send() -> str:
        try:
            async for _ in stub.Generate(tandem_pb2.GenerateRequest(prompt=prompt, max_tokens=2), metadata=metadata):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "OK"
    return send


@dataclasses.dataclass
class RoundResult:
    idle: Samples
    loaded: Samples
    answers: list[tuple[str, str, float]]  # (kind, status, seconds) of each large request


async def one_round(prober: Prober, senders: list, load: ProbeLoad) -> RoundResult:
    """The probes alone for load.baseline_s, then with load.large_requests sent at once until all are answered."""
    stop = asyncio.Event()
    idle = asyncio.ensure_future(prober.poll(stop))
    await asyncio.sleep(load.baseline_s)
    stop.set()
    idle_samples, stop = await idle, asyncio.Event()
    loaded = asyncio.ensure_future(prober.poll(stop))

    async def timed(kind: str, send) -> tuple[str, str, float]:
        start = time.perf_counter()
        status = await send()
        return kind, status, time.perf_counter() - start

    picks = [senders[index % len(senders)] for index in range(load.large_requests)]
    try:
        answers = await asyncio.wait_for(asyncio.gather(*(timed(kind, send) for kind, send in picks)), load.timeout_s)
    finally:
        stop.set()
    return RoundResult(idle_samples, await loaded, answers)


async def measure(base_url: str, grpc_target: str | None, load: ProbeLoad) -> list[RoundResult]:
    """load.rounds rounds against the server at base_url (and its gRPC front end at grpc_target). Raises
    ServerUnreachable when GET /v1/models does not answer."""
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else None
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        model = await served_model(session, base_url)
        channel = _grpc_channel(grpc_target)
        try:
            prober = Prober(session, base_url, channel)  # the probes need no API key
            prompt = "ab " * (load.prompt_bytes // 3)
            senders = large_senders(session, base_url, model, prompt, channel, load.api_key)
            return [await one_round(prober, senders, load) for _ in range(load.rounds)]
        finally:
            if channel is not None:
                await channel.close()


def _grpc_channel(target: str | None):
    if target is None:
        return None
    import grpc
    return grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])


def summary(rounds: list[RoundResult]) -> dict:
    """Per probe, both phases over every round: answers, failures, p50 / p99 / max ms; per kind of large request:
    its statuses and slowest time; the worst probe under load."""
    def phase(pick) -> dict:
        names = list(dict.fromkeys(name for r in rounds for name in pick(r).latencies))
        out = {}
        for name in names:
            values = [v for r in rounds for v in pick(r).latencies.get(name, [])]
            out[name] = {"answers": len(values), "failures": sum(pick(r).failures.get(name, 0) for r in rounds),
                         "p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3,
                         "max_ms": max(values) * 1e3}
        return out
    large: dict[str, dict] = {}
    for kind, status, seconds in (answer for r in rounds for answer in r.answers):
        entry = large.setdefault(kind, {"statuses": {}, "max_s": 0.0})
        entry["statuses"][status] = entry["statuses"].get(status, 0) + 1
        entry["max_s"] = max(entry["max_s"], seconds)
    loaded = phase(lambda r: r.loaded)
    return {"idle": phase(lambda r: r.idle), "loaded": loaded, "large": large,
            "worst_loaded_ms": max(p["max_ms"] for p in loaded.values())}


def format_report(result: dict, load: ProbeLoad) -> str:
    lines = [f"{load.rounds} round(s) of {load.large_requests} requests of {load.prompt_bytes / 1e6:.1f} MB at once",
             f"{'probe':<18} {'idle p50':>9} {'idle max':>9} {'load p50':>9} {'load p99':>9} {'load max':>9} "
             f"{'answers':>8} {'failed':>7}"]
    for name, loaded in result["loaded"].items():
        idle = result["idle"].get(name, {"p50_ms": float("nan"), "max_ms": float("nan")})
        lines.append(f"{name:<18} {idle['p50_ms']:9.1f} {idle['max_ms']:9.1f} {loaded['p50_ms']:9.1f} "
                     f"{loaded['p99_ms']:9.1f} {loaded['max_ms']:9.1f} {loaded['answers']:8d} {loaded['failures']:7d}")
    for kind, entry in result["large"].items():
        statuses = ", ".join(f"{status} x{count}" for status, count in sorted(entry["statuses"].items()))
        lines.append(f"large {kind}: {statuses}; slowest {entry['max_s']:.2f} s")
    worst = result["worst_loaded_ms"]
    lines.append(f"worst probe under load: {worst:.1f} ms ({'within' if worst <= TARGET_MS else 'over'} "
                 f"the {TARGET_MS:.0f} ms target)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server's HTTP root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--grpc-target", default=None, help="its gRPC front end (host:port): also probe and load it")
    parser.add_argument("--large-requests", type=int, default=ProbeLoad.large_requests)
    parser.add_argument("--prompt-mb", type=float, default=ProbeLoad.prompt_bytes / 1e6)
    parser.add_argument("--baseline-s", type=float, default=ProbeLoad.baseline_s, help="probes alone per round")
    parser.add_argument("--rounds", type=int, default=ProbeLoad.rounds)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", default=None, help="write the summary as JSON here")


def run(args: argparse.Namespace) -> int:
    """0 when it ran (failed probes are reported, not fatal), 1 if the server is unreachable; ValueError (exit 2
    from the CLI) on invalid flags."""
    load = ProbeLoad(args.large_requests, int(args.prompt_mb * 1e6), args.baseline_s, args.rounds,
                     api_key=args.api_key)
    try:
        rounds = asyncio.run(measure(args.base_url.rstrip("/"), args.grpc_target, load))
    except (ServerUnreachable, OSError, asyncio.TimeoutError) as error:
        print(f"tandem bench probes: {error}", file=sys.stderr)
        return 1
    result = summary(rounds)
    print(format_report(result, load))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0
