"""RequestFlow's merge of the two workers' answers when they race, driven with stand-in actors (no Ray): the
decode worker's end of a request may reach the coordinator before or after the prefill worker's report,
and the request's outcome must not depend on which came first."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.backend import GenerationRequest
from cluster.coordinator.request_flow import FlowHooks, RequestFlow, WorkerLost, WorkerRef
from decode_worker import DecodeEnded, DecodeStatus
from engine import SamplingParams
from kv_transfer.config import ReceiverAddress
from prefill_worker import PrefillReport, PrefillStatus

RID = "r#1"


class _Method:
    """What a Ray actor method handle offers the flow: .remote(...)."""

    def __init__(self, call) -> None:
        self._call = call

    def remote(self, *args):
        return self._call(*args)


class StandInActor:
    """A prefill actor whose report comes `delay_s` after the call; every cancel is recorded."""

    def __init__(self, report: PrefillReport | None = None, delay_s: float = 0.0) -> None:
        self.report, self.delay_s, self.cancels, self.reported = report, delay_s, [], False
        self.prefill = _Method(self._prefill)
        self.cancel = _Method(self.cancels.append)

    async def _prefill(self, task):
        await asyncio.sleep(self.delay_s)
        self.reported = True
        return self.report


def _report(status: PrefillStatus, **fields) -> PrefillReport:
    return PrefillReport(RID, status, "prefill-0", time.time(), **fields)


async def _run(prefill: StandInActor, decode: StandInActor, decode_events: list) -> list:
    mailbox: asyncio.Queue = asyncio.Queue()
    for event in decode_events:
        mailbox.put_nowait(event)
    request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=1, temperature=0.0), time.perf_counter())
    hooks = FlowHooks(worker_lost=lambda name: None, is_alive=lambda name: True, prefill_done=lambda: None)
    flow = RequestFlow(request, RID, WorkerRef("prefill-0", prefill), WorkerRef("decode-0", decode),
                       ReceiverAddress("grpc", target="127.0.0.1:1"), mailbox, hooks)
    return [chunk async for chunk in flow.chunks()]


def test_a_first_token_that_ends_the_request_wins_over_the_aborted_transfer_that_arrived_first():
    """The prefill worker's first token ended the request, so it aborted the layer stream; the decode
    worker's 'transfer failed' came before the report. The client gets the token, not the failure."""
    finished = _report(PrefillStatus.FINISHED, first_token=7, text="x", finish_reason="length")
    prefill, decode = StandInActor(finished, delay_s=0.05), StandInActor()
    aborted = DecodeEnded(RID, DecodeStatus.TRANSFER_FAILED, "LENGTH_MISMATCH: the stream's tail never arrived")
    [chunk] = asyncio.run(_run(prefill, decode, [aborted]))
    assert chunk.token_ids == (7,) and chunk.finish_reason == "length"
    assert chunk.timing is not None and chunk.timing.prefill_worker == "prefill-0"
    assert prefill.cancels == [] and decode.cancels == []  # both sides had already ended it


def test_a_transfer_both_sides_saw_fail_is_a_transfer_loss_whichever_answer_came_first():
    failed = _report(PrefillStatus.TRANSFER_FAILED, first_token=7, error="the receiver went away")
    aborted = DecodeEnded(RID, DecodeStatus.TRANSFER_FAILED, "PEER_FAILED: stream broke")
    for delay_s in (0.05, 0.0):
        with pytest.raises(WorkerLost) as lost:
            asyncio.run(_run(StandInActor(failed, delay_s=delay_s), StandInActor(), [aborted]))
        assert lost.value.role == "transfer"


def test_any_other_end_on_the_decode_side_fails_the_request_at_once_and_cancels_the_prefill():
    prefill = StandInActor(_report(PrefillStatus.SHIPPED, first_token=7), delay_s=5.0)  # would come much later
    invalid = DecodeEnded(RID, DecodeStatus.INVALID, "prompt too long")
    with pytest.raises(ValueError, match="prompt too long"):
        asyncio.run(_run(prefill, StandInActor(), [invalid]))
    assert not prefill.reported and prefill.cancels == [RID]  # it did not wait for the report
