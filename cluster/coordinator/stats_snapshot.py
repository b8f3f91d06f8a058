"""StatsSnapshot: the workers' stats as health() reports them, without a probe waiting long for a busy worker.

Coordinator.health() (behind /health, /ping, /metrics and gRPC Health) reports each worker's load, and asking the
workers costs a Ray call to each. Under load (prompts of megabytes being tokenized, steps keeping the cores busy)
such a round took up to ~130 ms on 2 cores, and every probe waited for one (issue 32: a probe answers within
100 ms). Now each call starts a round unless one is under way, and waits for it at most wait_s (25 ms) when an
earlier round has answered; past that it takes the last round's stats, and the round goes on in the background
(its answer serves the next call). A round on idle workers takes a few ms, so the answers stay current (a worker
found dead in a round is reported lost, as before); only the first call always waits. Who serves (the alive
workers, the router's counts, draining) is the coordinator's own state, read fresh by health(); only the loads
come from here.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

PROBE_WAIT_S = 0.025


class StatsSnapshot:
    """The stats `collect()` returned last, refreshed as described above. For one asyncio loop at a time."""

    def __init__(self, collect: Callable[[], Awaitable[dict]], wait_s: float = PROBE_WAIT_S):
        self._collect, self._wait_s = collect, wait_s
        self._stats: dict | None = None
        self._round: asyncio.Future | None = None

    async def get(self) -> dict:
        """The stats by worker name: this call's round's when it answers within wait_s (or there is no earlier
        answer), else the last round's."""
        if self._round is not None and self._round.get_loop() is not asyncio.get_running_loop():
            self._round = None  # left behind by a loop that has ended (asyncio.run per call)
        if self._round is None:
            self._round = asyncio.ensure_future(self._take())
            self._round.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: no warning
        try:
            await asyncio.wait_for(asyncio.shield(self._round), None if self._stats is None else self._wait_s)
        except asyncio.TimeoutError:
            pass  # the round goes on; its answer serves the next call
        return self._stats

    async def _take(self) -> None:
        try:
            self._stats = await self._collect()
        finally:
            self._round = None

    def close(self) -> None:
        """Cancels a round under way (at shutdown)."""
        if self._round is not None:
            self._round.cancel()
