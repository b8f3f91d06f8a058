"""cluster/workers/startup_heap.py: start-up objects leave the collector's sight; what serving creates is still collected."""
from __future__ import annotations

import gc
import weakref

from cluster.workers.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return first


def test_the_heap_at_start_up_is_frozen_and_later_cycles_are_still_collected() -> None:
    made_at_start_up = _cycle()
    try:
        frozen = freeze_startup_heap()
        # another thread of the test process (a daemon left by an earlier test) may free a frozen object between
        # the two calls: the count can only have gone down
        assert frozen >= 2 and frozen - 100 <= gc.get_freeze_count() <= frozen
        assert not any(obj is made_at_start_up for obj in gc.get_objects())  # out of every generation
        made_while_serving = _cycle()
        collected = weakref.ref(made_while_serving)
        del made_while_serving
        gc.collect()
        assert collected() is None
    finally:
        gc.unfreeze()
    assert any(obj is made_at_start_up for obj in gc.get_objects())
