"""StepObserver: what a caller of LLMEngine.step() can watch of one step (layer-wise KV streaming)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.sequence import Sequence


class StepObserver(Protocol):
    """Watches one engine step from the thread that calls step() (layer-wise KV streaming)."""

    def forward_starting(self, completing: list[Sequence]) -> Callable[[int], None] | None:
        """completing: the prefill-only sequences whose prompt this step finishes (PREFILLED after it,
        unless their first token ends them). Returns the per-layer callback for the forward, or None."""

    def forward_failed(self, error: str) -> None:
        """The forward raised after forward_starting returned a callback."""
