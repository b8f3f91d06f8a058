"""StatsSnapshot (cluster/coordinator/stats_snapshot.py): health()'s worker loads. The first call waits for its
round; later calls wait for theirs at most wait_s and otherwise take the last answer while the round goes on (one
round at a time); a round left behind by an ended loop does not block the next loop; close() cancels a round."""
from __future__ import annotations

import asyncio

from cluster.coordinator.stats_snapshot import StatsSnapshot


class SlowWorkers:
    """collect(): answers {"rounds": n} for its n-th round after `delay_s`."""

    def __init__(self, delay_s: float):
        self.delay_s, self.rounds = delay_s, 0

    async def collect(self) -> dict:
        self.rounds += 1
        number = self.rounds
        await asyncio.sleep(self.delay_s)
        return {"rounds": number}


def test_quick_rounds_answer_each_call_and_slow_ones_leave_the_last_answer():
    async def run():
        workers = SlowWorkers(0.001)
        snapshot = StatsSnapshot(workers.collect, wait_s=0.05)
        quick = [await snapshot.get(), await snapshot.get()]  # each call's own round
        workers.delay_s = 0.3
        slow = [await snapshot.get() for _ in range(3)]  # the round under way is not started again
        started_while_slow = workers.rounds
        await asyncio.sleep(0.35)
        after = await snapshot.get()  # the slow round answered meanwhile; this call starts the next
        snapshot.close()
        return quick, slow, started_while_slow, after

    quick, slow, started_while_slow, after = asyncio.run(run())
    assert quick == [{"rounds": 1}, {"rounds": 2}]
    assert slow == [{"rounds": 2}] * 3 and started_while_slow == 3
    assert after == {"rounds": 3}


def test_the_first_call_waits_however_long_its_round_takes():
    async def run():
        snapshot = StatsSnapshot(SlowWorkers(0.2).collect, wait_s=0.01)
        return await snapshot.get()

    assert asyncio.run(run()) == {"rounds": 1}


def test_a_round_left_by_an_ended_loop_does_not_hold_the_next_one():
    workers = SlowWorkers(0.001)
    snapshot = StatsSnapshot(workers.collect, wait_s=0.05)
    assert asyncio.run(snapshot.get()) == {"rounds": 1}
    workers.delay_s = 5.0

    async def leave_a_round_behind():
        return await snapshot.get()  # the round outlives this loop (asyncio.run cancels it)

    assert asyncio.run(leave_a_round_behind()) == {"rounds": 1}
    workers.delay_s = 0.001
    assert asyncio.run(snapshot.get()) == {"rounds": 3}  # a new round in the new loop
