"""Layer streaming from a tensor-parallel prefill group (prefill_worker/layer_streaming.py with a GroupStaging).

Each rank's pool holds its KV heads, so a streamed request's transfer sends the group's full-head staging blocks
(kv_transfer/group_pool.py) instead of the engine's: when the step that completes its prompt starts, staging
blocks are taken for its blocks, the step's message tells every rank to gather those blocks' layers to rank 0
(TPLeader.stream_next_step), and the forward's layer callback writes each gathered layer into the staging blocks
before it tells the stream's clock the layer is done. The engine's blocks go back to the engine when the step has
completed (the staging blocks hold their KV); the staging blocks go to the transfer (LayerStream.finish) or, when
the stream aborts or its step fails, back to the staging pool.

Step thread only.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kv_transfer.group_pool import GroupStaging
from kv_transfer.layer_stream import LayerClock


class GroupStreams:
    """The staging blocks of a group's streamed requests, from the step that starts them until they are handed on."""

    def __init__(self, staging: GroupStaging) -> None:
        self.staging = staging
        self._leader = staging.engine.tp_leader
        self._blocks: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (engine blocks, staging blocks)
        self._step: list[str] = []  # the requests the coming step streams

    def stage(self, request_id: str, engine_blocks: Sequence[int]) -> list[int] | None:
        """Staging blocks for a request the coming step streams (None, nothing taken, when the pool is short:
        the request is then sent whole after the step)."""
        staged = self.staging.allocate(len(engine_blocks))
        if staged is not None:
            self._blocks[request_id] = (list(engine_blocks), staged)
            self._step.append(request_id)
        return staged

    @property
    def streams_next_step(self) -> bool:
        """Whether the coming step streams staged requests (its layer callback must gather them: layer_hook)."""
        return bool(self._step)

    def unstage(self, request_id: str) -> None:
        """A stream that did not start after all: its staging blocks go back."""
        self._step.remove(request_id)
        self.staging.free(self._blocks.pop(request_id)[1])

    def layer_hook(self, clock: LayerClock) -> Callable[[int], None]:
        """The coming step's layer callback: every rank gathers layer l of the streamed blocks to rank 0, which
        writes it into their staging blocks, then the clock hears the layer is done."""
        engine_blocks = [b for rid in self._step for b in self._blocks[rid][0]]
        staged = [b for rid in self._step for b in self._blocks[rid][1]]
        ids = self._leader.stream_next_step(engine_blocks)
        self._step = []

        def layer_done(layer: int) -> None:  # every head written once, straight into the staging blocks' layer
            self._leader.gather_layer(layer, ids, out=self.staging.kv[layer], out_blocks=staged)
            clock.layer_done(layer)

        return layer_done

    def hand_over(self, request_id: str, engine_blocks: Sequence[int]) -> list[int]:
        """The step completed the request's prompt: engine_blocks (its blocks the caller took from the engine) go
        back to the engine, their KV being in the staging blocks, which are returned (for LayerStream.finish)."""
        _, staged = self._blocks.pop(request_id)
        self.staging.engine.free_blocks(engine_blocks)
        return staged

    def release(self, request_id: str) -> None:
        """The request's stream ended without its blocks (aborted, its step failed): staging blocks back."""
        if request_id in self._blocks:
            self.staging.free(self._blocks.pop(request_id)[1])

    def release_all(self) -> None:
        for request_id in list(self._blocks):
            self.release(request_id)
        self._step = []
