"""PrefillWorker: an LLMEngine that only prefills, and ships each prompt's KV to a decode worker.

One step thread owns the engine; other threads talk to it through a command queue (submit, cancel,
stop). Each step packs every queued prompt the token budget allows (the engine's packed, chunked prefill,
logits only for the last prompt token) and samples the first token. The KV goes to the transfer plane
layer by layer while the step that completes the prompt runs (prefill_worker/layer_streaming.py), or
whole after it (kv_transfer.engine_pool.ship_prefilled); the transfer frees the blocks once the decode
worker acknowledged them or it failed. The engine keeps its prefix cache across requests. Every task's
future resolves exactly once, with a PrefillReport.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future

from engine.core.command_queue import take_commands
from engine.core.llm_engine import LLMEngine
from engine.core.step_watch import StepHealth, StepWatch
from engine.outputs import StepDelta
from engine.runner.openmp_pools import start_stepping_thread
from kv_transfer import KVTransferError, ReceiverAddress, TransferHandle
from kv_transfer.lanes import GroupLanes
from prefill_worker.commands import Cancel, Live, Stop, Submit, TransferDone
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.kv_senders import KVSenders
from prefill_worker.layer_streaming import LayerStreaming
from prefill_worker.messages import PrefillReport, PrefillStats, PrefillStatus, PrefillTask, collect_stats
from prefill_worker.transfer_slots import TransferSlots

logger = logging.getLogger("tandem.prefill_worker")


class PrefillWorker:
    """Owns `engine` from construction until stop(); starts its step thread at once."""

    def __init__(self, engine: LLMEngine, config: PrefillWorkerConfig, lanes: GroupLanes | None = None) -> None:
        """lanes: a tensor-parallel engine's, when its followers were started with them
        (prefill_worker/kv_senders.py)."""
        self.name, self._engine, self._config = config.name, engine, config
        self._senders = KVSenders(engine, config, lanes)
        self._staging = self._senders.staging
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, Live] = {}
        self._slots = TransferSlots(config.transfer_slots_per_peer)
        streams = config.kv_streaming == "layer" and config.transport != "ipc"
        self._streaming = LayerStreaming(engine, self._senders.sender, self._slots, self._live, self._watch_transfer,
                                         self._staging, self._senders.lanes) if streams else None
        self._stopped = threading.Event()
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-step", daemon=True)
        self._watch = StepWatch(self._thread)
        start_stepping_thread(self._thread)  # this thread built the engine; that one steps it

    # ---- any thread ----------------------------------------------------------------------------
    def submit(self, task: PrefillTask) -> Future:
        """Queue a task; the returned Future resolves with its PrefillReport (never raises). The report
        is INVALID if the engine rejects the input, CANCELLED if the worker stops first."""
        future: Future = Future()
        if self._stopped.is_set():
            future.set_result(PrefillReport(task.request_id, PrefillStatus.CANCELLED, self.name, time.time(),
                                            error="the prefill worker is stopped"))
        else:
            self._commands.put(Submit(task, future, time.time()))
        return future

    def cancel(self, request_id: str) -> None:
        """Queue a cancel: a queued, prefilling or slot-waiting task leaves the engine (blocks freed) and
        is reported CANCELLED at once. A transfer already on the wire runs to its end (the decode worker
        frees a delivery nobody expects; the transfer frees the sender's blocks) and is then reported
        CANCELLED. (TransferHandle.cancel() is not used: a grpc.aio call cancelled before its initial
        metadata went out leaves the sender's pending write waiting forever, blocks held.) No-op once
        reported."""
        self._commands.put(Cancel(request_id))

    def forget_kv_peer(self, peer: ReceiverAddress) -> None:
        """The decode worker at `peer` left (drained: nothing is in flight to it): the sender closes what it
        keeps for it."""
        self._senders.forget_peer(peer)

    def stats(self) -> PrefillStats:
        """The load as of the step thread's last iteration. Changes nothing."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self, stall_timeout_s: float) -> StepHealth:
        """Unhealthy when the step thread died or is stuck in a step for stall_timeout_s. Changes nothing."""
        return self._watch.health(stall_timeout_s)

    def stop(self) -> None:
        """Cancel every task (reports CANCELLED), wait for transfers in flight to end (they free their
        blocks), join the thread, then close the engine (its model and KV pool let go; stats() keeps the
        last snapshot, taken before). Blocks; idempotent."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._commands.put(Stop())
        self._thread.join()
        self._senders.close()
        if not self._engine.closed:
            self._stats = self._snapshot()
            self._engine.close()

    # ---- the step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._apply(self._next_commands()):
                if self._engine.has_unfinished_requests():
                    self._step()
                self._stats = self._snapshot()
                self._watch.beat()
        finally:
            self._end_all("the prefill worker is stopping")
            self._stats = self._snapshot()

    def _next_commands(self) -> list:
        """Blocks for a command while the engine is idle; otherwise takes whatever is queued."""
        return take_commands(self._commands, block=not self._engine.has_unfinished_requests(), watch=self._watch)

    def _apply(self, commands: list) -> bool:
        for command in commands:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Submit):
                self._admit(command)
            elif isinstance(command, Cancel):
                self._cancel(command.request_id)
            else:
                self._transfer_done(command)
        return True

    def _admit(self, command: Submit) -> None:
        task, received = command.task, command.received_at
        report = PrefillReport(task.request_id, PrefillStatus.SHIPPED, self.name, received)
        if task.request_id in self._live:
            command.future.set_result(_failed(report, PrefillStatus.INVALID, "request id already in use"))
            return
        try:
            task.check_cached_blocks(self._engine.config.block_size)
            self._engine.add_request(task.request_id, task.prompt_token_ids, task.params, prefill_only=True,
                                     arrival_time=time.perf_counter(), num_resumed_tokens=task.num_resumed_tokens)
        except ValueError as error:
            command.future.set_result(_failed(report, PrefillStatus.INVALID, str(error)))
            return
        self._live[task.request_id] = Live(task, command.future, report)

    def _cancel(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.cancelled:
            return
        live.cancelled = True
        if live.handle is not None:  # on the wire: stop it; reported CANCELLED when it ends (it frees the blocks)
            live.handle.cancel()
            return
        self._drop(request_id, live)
        self._resolve(request_id, PrefillStatus.CANCELLED, "cancelled")

    def _drop(self, request_id: str, live: Live) -> None:
        """Frees what a task not on the wire holds: queued, prefilling, or prefilled waiting for a slot."""
        if live.waiting_for_slot:
            self._slots.discard(live.task.decode_address, request_id)
        self._engine.abort(request_id)

    def _step(self) -> None:
        started = time.time()
        try:
            deltas = self._engine.step(self._streaming)
        except Exception as error:
            logger.exception("%s: engine step failed; failing every request in the engine", self.name)
            self._fail_unshipped(PrefillStatus.FAILED, f"engine step failed: {error}")
            return
        ended = time.time()
        self._mark_started(started)
        for delta in deltas:
            self._prefilled(delta, ended)

    def _mark_started(self, step_started: float) -> None:
        """A task's prefill started in this step if it has computed tokens now (or left the engine)."""
        for request_id, live in self._live.items():
            if live.report.prefill_started is None:
                seq = self._engine.get_sequence(request_id)
                if seq is None or seq.num_computed_tokens > 0:
                    live.report = dataclasses.replace(live.report, prefill_started=step_started)

    def _prefilled(self, delta: StepDelta, now: float) -> None:
        live = self._live.get(delta.request_id)
        if live is None:
            return
        cached = delta.metrics.num_cached_tokens if delta.metrics is not None else 0
        first_logprobs = delta.logprobs[0] if delta.logprobs else None
        live.report = dataclasses.replace(live.report, first_token=delta.new_token_ids[0], text=delta.new_text,
                                          first_logprobs=first_logprobs, prompt_logprobs=delta.prompt_logprobs,
                                          prefill_ended=now, num_cached_tokens=cached)
        if live.stream is not None and self._streaming.complete(delta, live):
            return  # its KV is streaming; the transfer's end reports it
        if delta.kv_block_ids is None:  # the first token ended the request; the engine freed its blocks
            live.report = dataclasses.replace(live.report, finish_reason=delta.finish_reason)
            self._resolve(delta.request_id, PrefillStatus.FINISHED)
            if live.stream is not None:  # its aborted stream gives its slot up now
                self._release_slot(live.task.decode_address)
            return
        if self._slots.acquire(live.task.decode_address, delta.request_id):
            self._ship(delta.request_id)
        else:
            live.waiting_for_slot = True

    def _ship(self, request_id: str) -> None:
        """Sends a prefilled request's KV (it holds a transfer slot); a send that fails at once passes
        the slot on."""
        while request_id is not None:
            live = self._live[request_id]
            live.waiting_for_slot = False
            live.report = dataclasses.replace(live.report, transfer_started=time.time())
            try:
                live.handle = self._senders.ship(live.task.decode_address, request_id, live.report.first_logprobs,
                                                 live.task.decode_cached_blocks)
            except Exception as error:  # ship_prefilled freed the blocks
                self._resolve(request_id, PrefillStatus.TRANSFER_FAILED, f"send failed: {error}")
                request_id = self._slots.release(live.task.decode_address)
                continue
            self._watch_transfer(request_id, live.handle)
            return

    def _watch_transfer(self, request_id: str, handle: TransferHandle) -> None:
        handle.add_done_callback(lambda h, rid=request_id: self._commands.put(TransferDone(rid, h, time.time())))

    def _transfer_done(self, done: TransferDone) -> None:
        live = self._live.get(done.request_id)
        if live is None or live.handle is not done.handle:
            return
        live.report = dataclasses.replace(live.report, transfer_ended=done.ended_at)
        self._settle_transfer(done, live)
        self._release_slot(live.task.decode_address)

    def _release_slot(self, peer) -> None:
        next_request = self._slots.release(peer)
        if next_request is not None:
            self._ship(next_request)

    def _settle_transfer(self, done: TransferDone, live: Live) -> None:
        error = done.handle.exception(timeout=0)
        if error is None:
            live.report = dataclasses.replace(live.report, kv_bytes=done.handle.result(timeout=0).kv_bytes)
        if live.cancelled:
            self._resolve(done.request_id, PrefillStatus.CANCELLED, "cancelled")
        elif error is None:
            self._resolve(done.request_id, PrefillStatus.SHIPPED)
        else:
            message = str(error) if isinstance(error, KVTransferError) else f"{type(error).__name__}: {error}"
            self._resolve(done.request_id, PrefillStatus.TRANSFER_FAILED, message)

    def _resolve(self, request_id: str, status: PrefillStatus, error: str = "") -> None:
        live = self._live.pop(request_id)
        live.future.set_result(dataclasses.replace(live.report, status=status, error=error))

    def _fail_unshipped(self, status: PrefillStatus, message: str) -> None:
        """Ends every task the engine still holds (not those whose KV is on the wire; those streaming from
        the failed step too: their streams abort and the engine frees their blocks)."""
        for request_id, live in list(self._live.items()):
            streamed = self._streaming is not None and self._streaming.unfinished(live)
            if live.handle is None or streamed:
                self._drop(request_id, live)
                self._resolve(request_id, status, message)
            if streamed:
                live.stream.abort(message)
                self._release_slot(live.task.decode_address)

    def _end_all(self, message: str) -> None:
        """Stop: tasks in the engine are aborted; transfers in flight run to their end (they free their
        blocks; sender.close() waits for that). Every report goes out now, CANCELLED."""
        for request_id, live in list(self._live.items()):
            if live.handle is None:
                self._drop(request_id, live)
            self._resolve(request_id, PrefillStatus.CANCELLED, message)
        for command in take_commands(self._commands, block=False):  # submitted after the stop command
            if isinstance(command, Submit):
                report = PrefillReport(command.task.request_id, PrefillStatus.CANCELLED, self.name, time.time())
                command.future.set_result(_failed(report, PrefillStatus.CANCELLED, message))

    def _snapshot(self) -> PrefillStats:
        return collect_stats(self.name, self._engine, self._live.items(), self._staging, self._senders.lane_transfers)


def _failed(report: PrefillReport, status: PrefillStatus, error: str) -> PrefillReport:
    return dataclasses.replace(report, status=status, error=error)
