"""A decode worker's channel without Ray: the actor-side EventBatcher and ChannelServer
(cluster/workers/event_batcher.py, decode_channel.py) and the coordinator-side DecodeEventPump
(cluster/coordinator/decode_events.py), over a real loopback connection."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
from ray.exceptions import RayActorError

from cluster.coordinator.decode_events import ChannelCallFailed, DecodeEventPump, WorkerStreamLost
from cluster.workers.decode_channel import SECRET_BYTES, ChannelAddress, ChannelServer, read_frame
from cluster.workers.event_batcher import EventBatcher
from decode_worker import Admission, DecodeChunk, DecodeEnded, DecodeStatus, ExpectedRequest
from engine.sampling_params import SamplingParams


def chunk(request_id: str, token: int, finish: str | None = None) -> DecodeChunk:
    return DecodeChunk(request_id, (token,), "", finish)


def test_batcher_keeps_order_across_threads_and_ends_after_close():
    async def scenario():
        batcher = EventBatcher(asyncio.get_running_loop())
        collected = []

        async def consume():
            async for batch in batcher.batches():
                assert batch
                collected.extend(batch)

        consumer = asyncio.ensure_future(consume())
        producers = [threading.Thread(target=lambda p=p: [batcher.put(chunk(f"r{p}", i)) for i in range(200)])
                     for p in range(3)]
        for producer in producers:
            producer.start()
        for producer in producers:
            producer.join()
        batcher.close()
        await asyncio.wait_for(consumer, 10)
        return collected

    collected = asyncio.run(scenario())
    assert len(collected) == 600
    for p in range(3):
        assert [c.token_ids[0] for c in collected if c.request_id == f"r{p}"] == list(range(200))


def test_a_new_consumer_takes_over_and_the_old_one_ends():
    async def scenario():
        batcher = EventBatcher(asyncio.get_running_loop())
        old = batcher.batches()
        batcher.put(chunk("a", 1))
        first = await anext(old)
        new = batcher.batches()
        batcher.put(chunk("a", 2))
        taken = await anext(new)
        leftover = [batch async for batch in old]  # wakes, sees it was replaced, ends without taking
        return first, taken, leftover

    first, taken, leftover = asyncio.run(scenario())
    assert first == [chunk("a", 1)] and taken == [chunk("a", 2)] and leftover == []


class FakeDecodeWorker:
    """What the channel serves: expect() accepts every request but "full" (refused) and "bad" (raises), and
    keeps the emit it was given (the channel's batcher), which emit() then calls from any thread."""

    def __init__(self) -> None:
        self.expected: list[str] = []
        self.emit = None
        self.server = ChannelServer(self.expect)

    def expect(self, request: ExpectedRequest, emit) -> Admission:
        if request.request_id == "bad":
            raise ValueError("a bad request")
        self.expected.append(request.request_id)
        self.emit = emit
        return Admission(request.request_id != "full", "full" if request.request_id == "full" else "")


def expected(request_id: str) -> ExpectedRequest:
    return ExpectedRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=4))


def opened(address: ChannelAddress):
    async def open_channel() -> ChannelAddress:
        return address
    return open_channel


def test_expect_is_answered_and_events_reach_open_mailboxes_only():
    async def scenario():
        worker, lost = FakeDecodeWorker(), []
        pump = DecodeEventPump("d", opened(await worker.server.start("127.0.0.1")), lambda *args: lost.append(args))
        a, b = pump.open("a"), pump.open("b")
        admissions = [await pump.expect(expected(name)) for name in ("a", "b", "full")]
        for batch in ([chunk("a", 1), chunk("gone", 9)], [chunk("b", 2), chunk("a", 3, "length")]):
            threading.Thread(target=lambda events=batch: [worker.emit(e) for e in events]).start()
            await asyncio.sleep(0.05)
        got_a, got_b = [await a.get(), await a.get()], await b.get()
        pump.stop()
        worker.server.close()
        return admissions, got_a, got_b, worker.expected, lost

    admissions, got_a, got_b, asked, lost = asyncio.run(scenario())
    assert [(x.accepted, x.reason) for x in admissions] == [(True, ""), (True, ""), (False, "full")]
    assert got_a == [chunk("a", 1), chunk("a", 3, "length")] and got_b == chunk("b", 2)
    assert asked == ["a", "b", "full"] and lost == []


def test_a_call_that_raises_fails_alone_and_the_channel_stays():
    async def scenario():
        worker, lost = FakeDecodeWorker(), []
        pump = DecodeEventPump("d", opened(await worker.server.start("127.0.0.1")), lambda *args: lost.append(args))
        with pytest.raises(ChannelCallFailed, match="ValueError: a bad request"):
            await pump.expect(expected("bad"))
        after = await pump.expect(expected("a"))
        pump.stop()
        return after, lost

    after, lost = asyncio.run(scenario())
    assert after.accepted and lost == []


def test_the_worker_stopping_ends_the_channel_and_every_mailbox_and_later_call_learns_it():
    async def scenario():
        worker, lost = FakeDecodeWorker(), []
        pump = DecodeEventPump("d", opened(await worker.server.start("127.0.0.1")), lambda w, e: lost.append(w))
        a = pump.open("a")
        await pump.expect(expected("a"))
        worker.emit(DecodeEnded("a", DecodeStatus.SHUTDOWN))
        worker.server.close()  # DecodeActor.stop(), after the worker's last event
        events = [await a.get(), await a.get()]
        late = await pump.open("c").get()
        with pytest.raises(WorkerStreamLost):
            await pump.expect(expected("c"))
        return events, late, lost

    events, late, lost = asyncio.run(scenario())
    assert events[0] == DecodeEnded("a", DecodeStatus.SHUTDOWN)
    assert isinstance(events[1], WorkerStreamLost) and isinstance(late, WorkerStreamLost) and lost == ["d"]


def test_a_connection_broken_under_a_call_fails_the_call_and_every_mailbox():
    async def scenario():
        asked = []

        async def dying(reader, writer):  # reads the secret and one call, then its process "dies"
            await reader.readexactly(SECRET_BYTES)
            asked.append(await read_frame(reader))
            writer.transport.abort()

        server, lost = await asyncio.start_server(dying, "127.0.0.1", 0), []
        address = ChannelAddress("127.0.0.1", server.sockets[0].getsockname()[1], b"s" * SECRET_BYTES)
        pump = DecodeEventPump("d", opened(address), lambda w, e: lost.append(w))
        a = pump.open("a")
        with pytest.raises(WorkerStreamLost):
            await pump.expect(expected("a"))
        server.close()
        return asked, await a.get(), lost

    asked, event, lost = asyncio.run(scenario())
    assert asked[0][0] == "expect" and asked[0][2].request_id == "a"
    assert isinstance(event, WorkerStreamLost) and lost == ["d"]


def test_a_wrong_secret_is_closed_before_anything_is_read():
    async def scenario():
        worker, lost = FakeDecodeWorker(), []
        address = await worker.server.start("127.0.0.1")
        wrong = ChannelAddress(address.host, address.port, bytes(SECRET_BYTES))
        pump = DecodeEventPump("d", opened(wrong), lambda w, e: lost.append(w))
        with pytest.raises(WorkerStreamLost):
            await pump.expect(expected("a"))
        worker.server.close()
        return worker.expected, lost

    asked, lost = asyncio.run(scenario())
    assert asked == [] and lost == ["d"]


def test_no_secret_garbage_and_silence_are_dropped_counted_and_the_channel_keeps_serving():
    """Each listener of the cluster closes a connection that has not shown its secret before reading
    anything else: here the decode channel, against a peer that closes at once, one that sends garbage in
    the secret's place, and one that says nothing past the deadline; then the coordinator is served."""
    async def scenario():
        worker = FakeDecodeWorker()
        worker.server = ChannelServer(worker.expect, secret_timeout_s=0.2)
        address = await worker.server.start("127.0.0.1")
        for payload in (b"", os.urandom(4096), None):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            if payload is None:
                await asyncio.sleep(0.4)          # silence past the deadline
            else:
                writer.write(payload)
                await writer.drain()
                if not payload:
                    writer.close()
            assert await asyncio.wait_for(reader.read(), 5) == b"", "the channel answered a stranger"
            writer.close()
        await asyncio.sleep(0.05)
        pump = DecodeEventPump("d", opened(address), lambda *args: None)
        admission = await pump.expect(expected("after"))
        pump.stop()
        worker.server.close()
        return dict(worker.server.drops), admission, worker.expected

    drops, admission, asked = asyncio.run(scenario())
    assert drops == {"closed": 1, "unauthenticated": 1, "timeout": 1}, drops
    assert admission.accepted and asked == ["after"]


def test_a_worker_that_died_before_its_channel_opened_is_lost():
    async def scenario():
        lost = []

        async def dead() -> ChannelAddress:
            raise RayActorError()

        pump = DecodeEventPump("d", dead, lambda w, e: lost.append((w, e)))
        a = pump.open("a")
        with pytest.raises(WorkerStreamLost) as raised:
            await pump.expect(expected("a"))
        return raised.value, await a.get(), lost

    raised, event, lost = asyncio.run(scenario())
    assert isinstance(raised.error, RayActorError) and event is raised
    assert [w for w, _ in lost] == ["d"] and isinstance(lost[0][1], RayActorError)


def test_a_worker_stopped_before_its_channel_opened_ends_the_connection_at_once():
    async def scenario():
        worker, lost = FakeDecodeWorker(), []
        worker.server.close()  # DecodeActor.stop() before the coordinator's first open_channel
        pump = DecodeEventPump("d", opened(await worker.server.start("127.0.0.1")), lambda w, e: lost.append(w))
        event = await pump.open("a").get()
        return event, lost

    event, lost = asyncio.run(scenario())
    assert isinstance(event, WorkerStreamLost) and "ended" in str(event) and lost == ["d"]


def test_a_worker_stopped_while_its_channel_starts_listening_ends_the_connection_at_once(monkeypatch):
    """stop() on the control thread can land after start() made the batcher and before its listener is up:
    nothing fails on the channel's loop, and a connection then ends at once, as after any stop()."""
    started, loop_errors = asyncio.start_server, []

    async def start_server_while_stopping(*args, **kwargs):
        await asyncio.to_thread(worker.server.close)  # the control group's thread, mid-start
        return await started(*args, **kwargs)

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        monkeypatch.setattr(asyncio, "start_server", start_server_while_stopping)
        lost = []
        pump = DecodeEventPump("d", opened(await worker.server.start("127.0.0.1")), lambda w, e: lost.append(w))
        return await pump.open("a").get(), lost

    worker = FakeDecodeWorker()
    event, lost = asyncio.run(scenario())
    assert isinstance(event, WorkerStreamLost) and "ended" in str(event) and lost == ["d"]
    assert loop_errors == []
