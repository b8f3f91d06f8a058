"""StepWatch: whether the thread that owns an engine is making progress, for health checks.

The thread that steps an engine (a prefill or decode worker's step thread) beats after every step and
every wake-up, and says when it goes to sleep waiting for commands (idle: healthy however long).
Any other thread may ask `health(stall_timeout_s)`: unhealthy when the step thread died, or when it has
not beaten for that long while not asleep (wedged in a step: a hung kernel, a deadlock, a lost device).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepHealth:
    """The answer to a health check; `reason` says what is wrong when not healthy."""

    healthy: bool
    reason: str = ""


class StepWatch:
    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread
        self._last_beat = time.monotonic()
        self._asleep = False

    def beat(self) -> None:
        """The step thread made progress (woke up, or finished a step)."""
        self._asleep = False
        self._last_beat = time.monotonic()

    def sleeping(self) -> None:
        """The step thread is about to block waiting for commands (it has no work)."""
        self._asleep = True

    def health(self, stall_timeout_s: float) -> StepHealth:
        """Healthy unless the thread died or has been busy without a beat for stall_timeout_s."""
        if not self._thread.is_alive():
            return StepHealth(False, "its step thread died")
        stalled_s = 0.0 if self._asleep else time.monotonic() - self._last_beat
        if stalled_s > stall_timeout_s:
            return StepHealth(False, f"its step thread has not completed a step for {stalled_s:.1f}s")
        return StepHealth(True)
