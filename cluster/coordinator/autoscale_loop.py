"""AutoscaleLoop: every policy.interval_s, a snapshot of the coordinator's numbers, a decision, applied.

    loop = AutoscaleLoop(policy, scaling.snapshot, scaling.scale)   # on the coordinator's asyncio loop
    ...
    loop.stop()

The decision is cluster/coordinator/autoscaler.py's pure decide(); this loop only feeds it and applies
what it decides through the same call an admin request makes (Scaling.scale: the bounds, the resource
check, the KV wiring, the drain). Each decision is logged with its reason and counted by role, action
(add, drain) and outcome (applied; refused: the scale call said no, e.g. past the cluster's resources;
failed: a worker did not start), for /metrics.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable

from cluster.coordinator.autoscaler import AutoscalePolicy, AutoscaleState, Decision, ScaleSnapshot, decide

logger = logging.getLogger("tandem.cluster.autoscaler")
HISTORY = 256  # decisions kept for inspection (GET /admin/workers, tests)


class AutoscaleLoop:
    def __init__(self, policy: AutoscalePolicy, snapshot: Callable[[], Awaitable[ScaleSnapshot]],
                 apply: Callable[[str, int], Awaitable[dict]]) -> None:
        """Starts at once on the running loop: the first decision comes policy.interval_s from now."""
        self.policy, self._snapshot, self._apply = policy, snapshot, apply
        self.decisions: Counter[tuple[str, str, str]] = Counter()   # (role, action, outcome) -> count
        self.history: deque[tuple[Decision, str]] = deque(maxlen=HISTORY)
        self._state = AutoscaleState()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed tick must not end autoscaling
                logger.exception("autoscale: a tick failed; trying again in %gs", self.policy.interval_s)

    async def tick(self) -> Decision | None:
        """One snapshot, one decision, applied (awaits the change: an added worker serving)."""
        decision, self._state = decide(await self._snapshot(), self.policy, self._state)
        if decision is None:
            return None
        action = "add" if decision.delta > 0 else "drain"
        logger.info("autoscale: %s a %s worker: %s", action, decision.role, decision.reason)
        try:
            await self._apply(decision.role, decision.delta)
            outcome = "applied"
        except ValueError as refused:
            outcome = "refused"
            logger.warning("autoscale: %s a %s worker refused: %s", action, decision.role, refused)
        except Exception as failed:  # noqa: BLE001 - e.g. a worker that did not start (nothing changed)
            outcome = "failed"
            logger.warning("autoscale: %s a %s worker failed: %s", action, decision.role, failed)
        self.decisions[(decision.role, action, outcome)] += 1
        self.history.append((decision, outcome))
        return decision

    def stop(self) -> None:
        """Stop deciding; a change under way finishes (Scaling shields it)."""
        if not self._task.get_loop().is_closed():
            self._task.cancel()
