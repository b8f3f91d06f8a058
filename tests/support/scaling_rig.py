"""Shared by the scaling tests (tests/cluster/test_scaling.py): requests streaming in waves through a
coordinator whose workers change, the worker set as the admin surface shows it, and the checks that a
drained worker left nothing behind."""
from __future__ import annotations

import asyncio
import time

import ray
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster_rig import collect, greedy, request, wait_until_idle
from tests.support.serve_process import live_processes

PARAMS = greedy(16)


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pids & set(live_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not pids & set(live_processes())


async def wait_for(condition, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(0.1)


def wave(coordinator, tag: str, prompts, decoding: asyncio.Queue | None = None, params=PARAMS) -> list:
    """(prompt, task) per prompt: its request streaming through the coordinator."""
    return [(p, asyncio.ensure_future(collect(coordinator, request(f"{tag}{i}", p, params), decoding)))
            for i, p in enumerate(prompts)]


async def finish(coordinator, requests: list, oracle) -> list:
    """The last chunk of every request once all ended (each one's tokens the colocated engine's), after
    every drain settled and every pool is whole."""
    results = await asyncio.gather(*(task for _, task in requests))
    for (prompt, _), (tokens, last) in zip(requests, results):
        assert last.finish_reason == "length" and tokens == oracle[prompt], f"{len(prompt)}-token prompt differs"
    await coordinator.scaling.settled()
    await wait_until_idle(coordinator)
    return [last for _, last in results]


def workers_in(coordinator, role: str, state: str = "serving") -> list[str]:
    return [name for name, w in coordinator.scaling.describe()["workers"].items()
            if (w["role"], w["state"]) == (role, state)]


def samples(metrics: str, name: str) -> dict[tuple, float]:
    """The samples of one series: sorted label items -> value."""
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(metrics)
            for s in family.samples if s.name == name}


def victim(answer: dict) -> str:
    (name,) = answer["draining"]
    assert answer["workers"][name]["state"] == "draining"
    return name


def whereabouts(coordinator) -> dict[str, tuple[int, object]]:
    """(pid, bundle slot) of every running worker, to check a drained one's once it stopped (an idle one
    stops at once)."""
    return {name: (coordinator._workers[name].info.pid, coordinator._set.member(name).slot)
            for name in coordinator._workers if coordinator.is_alive(name)}


def released(pids_and_slots: list) -> None:
    """The drained workers' processes are gone; a group of its own is removed (a start-group bundle is kept
    for the next worker of the role: tests/cluster/test_autoscaler.py)."""
    assert wait_gone({pid for pid, _ in pids_and_slots}), "a drained worker's process is still alive"
    table = ray.util.placement_group_table()
    assert all(table[slot.group.id.hex()]["state"] == "REMOVED" for _, slot in pids_and_slots if slot.owned)
