"""HealthMonitor: finds workers that are alive as processes but no longer serve (wedged), and reports them.

Every interval it asks each worker the coordinator still routes to for its health (`actor.health`: the
step thread is alive and has completed a step within the stall timeout, or sleeps for lack of work). A
worker that answers unhealthy, or does not answer within the stall timeout (its process hangs), or whose
actor is gone, is handed to `declare_lost(name, reason)`: the coordinator stops routing to it and kills
it, so its requests migrate to the survivors. Runs on the coordinator's asyncio loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from ray.exceptions import RayActorError

from cluster.workers.actors import WorkerInfo

logger = logging.getLogger("tandem.cluster.health")

STATS_TIMEOUT_S = 5.0


async def collect_stats(workers: Mapping[str, object], names: list[str],
                        worker_lost: Callable[[str, BaseException], None]) -> dict:
    """The stats (PrefillStats / DecodeStats) of each named worker, asked at once; one whose actor is gone
    is handed to worker_lost and left out, as is one that does not answer within STATS_TIMEOUT_S."""
    refs = [workers[name].actor.stats.remote() for name in names]
    results = await asyncio.gather(*(asyncio.wait_for(ref, STATS_TIMEOUT_S) for ref in refs),
                                   return_exceptions=True)
    stats = {}
    for name, result in zip(names, results):
        if isinstance(result, RayActorError):
            worker_lost(name, result)
        elif not isinstance(result, BaseException):
            stats[name] = result
    return stats


class HealthMonitor:
    def __init__(self, workers: Mapping[str, object], is_alive: Callable[[str], bool],
                 declare_lost: Callable[[str, str], None], stall_timeout_s: float, interval_s: float) -> None:
        """workers: a live mapping of name -> something with the worker's `actor` (the coordinator's
        WorkerSet.workers: workers added while serving are checked from the next interval on)."""
        self._workers, self._is_alive, self._declare_lost = workers, is_alive, declare_lost
        self._stall_timeout_s, self._interval_s = stall_timeout_s, interval_s
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    def on_running_loop(self) -> bool:
        return self._loop is asyncio.get_running_loop() and not self._task.done()

    def stop(self) -> None:
        if not self._loop.is_closed():
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            names = [name for name in self._workers if self._is_alive(name)]
            await asyncio.gather(*(self.check(name) for name in names))

    async def check(self, name: str) -> str | None:
        """One health check of worker `name`; declares it lost and returns the reason if it fails."""
        try:
            ref = self._workers[name].actor.health.remote(self._stall_timeout_s)
            health = await asyncio.wait_for(ref, self._stall_timeout_s)
        except asyncio.TimeoutError:
            reason = f"it did not answer a health check within {self._stall_timeout_s:g}s"
        except RayActorError as error:
            reason = f"its actor died: {error}"
        except Exception as error:  # noqa: BLE001 - any failure to answer counts against the worker
            reason = f"its health check failed: {error!r}"
        else:
            if health.healthy:
                return None
            reason = health.reason
        if self._is_alive(name):
            self._declare_lost(name, reason)
        return reason


DECODE_ROLES = ("decode", "replica")  # workers that decode (and report DecodeStats)


def health_details(infos: dict[str, WorkerInfo], stats: dict, dead: list[str], failures: dict[str, str]) -> dict:
    """BackendHealth.details of a disaggregated cluster (or of colocated replicas): the decode workers'
    (replicas') load summed (the keys ServingMetrics reads), each answering worker's role, pid and load
    under "workers", the dead workers, and why each lost worker was declared lost."""
    decode = [s for name, s in stats.items() if infos[name].role in DECODE_ROLES]
    replicas = any(info.role == "replica" for info in infos.values())
    return {"mode": "replicas" if replicas else "disaggregated", "running_requests": sum(s.running for s in decode),
            "waiting_requests": sum(s.waiting for s in decode),
            "free_kv_blocks": sum(s.free_blocks for s in decode),
            "total_kv_blocks": sum(s.total_blocks for s in decode),
            "dead_workers": sorted(dead), "worker_failures": dict(failures),
            "workers": {name: _worker_load(infos[name], s) for name, s in stats.items()}}


def _worker_load(info: WorkerInfo, stats) -> dict:
    """One worker's entry of details["workers"] (the per-worker /metrics gauges; its pid and Ray node)."""
    decode = info.role in DECODE_ROLES
    load = {"role": info.role, "pid": info.pid, "node_id": info.node_id, "node_ip": info.node_ip,
            "free_kv_blocks": stats.free_blocks, "total_kv_blocks": stats.total_blocks,
            "running_requests": stats.running if decode else stats.live_requests}
    if decode:
        load["dropped_connections"] = stats.dropped_connections
    return load
