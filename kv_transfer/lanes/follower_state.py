"""What a follower's lane keeps between rank 0's commands and its transfers: the blocks rank 0's Expect named per
request (ExpectedBlocks, a decode follower) and a LayerClock per step of its own forward (StepClocks, a prefill
follower's layer-streamed parts)."""
from __future__ import annotations

import threading
import time

import torch

from kv_transfer.layer_stream import LayerClock

EXPECT_WAIT_S = 5.0  # at most this long a follower's lane waits for rank 0's Expect (rank 0's own lane is late)


class ExpectedBlocks:
    """A decode follower's blocks per request as rank 0's Expect named them: a lane's transfer takes them (waiting up
    to wait_s for the Expect, which comes once rank 0's own lane of the request has arrived: about as soon as this
    one); Forget drops one not yet taken. The wait holds the thread that accepts the transfer (a gloo connection's;
    over gRPC an executor thread, not the event loop: the lane's pool says its allocation waits)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._forgotten: dict[str, float] = {}  # request id -> when: a transfer arriving later is refused at once
        self._changed = threading.Condition()

    def expect(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        with self._changed:
            self._forgotten.pop(request_id, None)
            self._blocks[request_id] = block_ids
            self._changed.notify_all()

    def forget(self, request_id: str) -> bool:
        """Drops request_id; True when it had an Expect no transfer took (its end is then the caller's to report)."""
        with self._changed:
            now = time.monotonic()
            self._forgotten = {rid: at for rid, at in self._forgotten.items() if now - at < 600}
            self._forgotten[request_id] = now
            self._changed.notify_all()
            return self._blocks.pop(request_id, None) is not None

    def take(self, request_id: str, num_blocks: int) -> list[int] | None:
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._blocks or request_id in self._forgotten, self.wait_s)
            blocks = self._blocks.pop(request_id, None)
        return list(blocks) if blocks is not None and len(blocks) == num_blocks else None


class StepClocks:
    """A follower's LayerClock per step number, made by whichever comes first: the step's forward (layer_done) or a
    streamed Ship of it (which may come after the step ran: the last KEEP_STEPS steps' clocks are kept)."""

    KEEP_STEPS = 64

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers, self.device = num_layers, device
        self._clocks: dict[int, LayerClock] = {}
        self._lock = threading.Lock()

    def clock(self, step: int) -> LayerClock:
        with self._lock:
            clock = self._clocks.get(step)
            if clock is None:
                clock = self._clocks[step] = LayerClock(self.num_layers, self.device)
                for old in [number for number in self._clocks if number < step - self.KEEP_STEPS]:
                    del self._clocks[old]
            return clock
