"""take_commands: how a thread that owns an engine reads its command queue between steps."""
from __future__ import annotations

import queue


def take_commands(commands: queue.Queue, block: bool, timeout: float | None = None) -> list:
    """Everything queued right now, in order. With block (the engine is idle), first sleeps until one
    command arrives or timeout seconds pass (None: no limit), so an idle step thread never spins."""
    taken = []
    if block:
        try:
            taken.append(commands.get(timeout=timeout))
        except queue.Empty:
            return taken
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken
