"""run_bounded: a blocking call (a Ray call during shutdown) that the caller stops waiting for after a timeout.

When Ray itself is going away (every process of a systemd unit gets SIGTERM at once, or its node died), a
call like ray.shutdown() or remove_placement_group() can wait for a long time on a GCS or raylet that will
not answer. Shutdown paths run such calls here: on a daemon thread, waited for at most timeout_s. A call
given up on keeps running; abandoned_calls() says how many do, so that the process can exit without
running exit hooks that would wait on them (ray.shutdown()'s lock is held by the abandoned call).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger("tandem.cluster.bounded")
_abandoned: list[threading.Thread] = []
_lock = threading.Lock()


def run_bounded(action: Callable[[], object], timeout_s: float) -> bool:
    """Runs `action()` on a daemon thread and waits at most timeout_s. True if it returned (or raised:
    logged) in time; False if it still runs (it is then counted by abandoned_calls())."""
    def run() -> None:
        try:
            action()
        except Exception:  # noqa: BLE001 - one release step failing must not stop the others
            logger.exception("%s failed", getattr(action, "__name__", action))

    thread = threading.Thread(target=run, name=f"tandem-bounded-{getattr(action, '__name__', 'call')}",
                              daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        with _lock:
            _abandoned.append(thread)
        return False
    return True


def abandoned_calls() -> int:
    """How many calls run_bounded gave up on are still running."""
    with _lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)
