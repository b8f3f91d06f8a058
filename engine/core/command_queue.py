"""take_commands: how a thread that owns an engine reads its command queue between steps."""
from __future__ import annotations

import queue

from engine.core.step_watch import StepWatch


def take_commands(commands: queue.Queue, block: bool, timeout: float | None = None,
                  watch: StepWatch | None = None) -> list:
    """Everything queued right now, in order. With block (the engine is idle), first sleeps until one
    command arrives or timeout seconds pass (None: no limit), so an idle step thread never spins.
    `watch` learns that the thread sleeps (healthy while it does) and beats when it wakes."""
    taken = []
    if block:
        if watch is not None:
            watch.sleeping()
        try:
            taken.append(commands.get(timeout=timeout))
        except queue.Empty:
            return taken
        finally:
            if watch is not None:
                watch.beat()
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken
