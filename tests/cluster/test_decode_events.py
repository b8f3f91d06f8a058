"""cluster/workers/event_batcher.py and cluster/coordinator/decode_events.py without Ray: the actor-side EventBatcher and the coordinator-side pump."""
from __future__ import annotations

import asyncio
import threading

from ray.exceptions import RayActorError

from cluster.coordinator.decode_events import DecodeEventPump, WorkerStreamLost
from cluster.workers.event_batcher import EventBatcher
from decode_worker import DecodeChunk, DecodeEnded, DecodeStatus


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


async def _stream(batches, error: BaseException | None):
    for batch in batches:
        yield asyncio.sleep(0, batch)
    if error is not None:
        raise error


def test_pump_routes_events_to_open_mailboxes_and_drops_the_rest():
    async def scenario():
        lost = []
        batches = [[chunk("a", 1), chunk("gone", 9)], [chunk("b", 2), chunk("a", 3, "length")]]
        gate = asyncio.Event()

        async def gated():
            await gate.wait()
            async for ref in _stream(batches, None):
                yield ref
            await asyncio.Event().wait()  # the stream stays open

        pump = DecodeEventPump("d", gated(), lambda *args: lost.append(args))
        a, b = pump.open("a"), pump.open("b")
        gate.set()
        got_a = [await a.get(), await a.get()]
        got_b = await b.get()
        pump.stop()
        return got_a, got_b, lost

    got_a, got_b, lost = asyncio.run(scenario())
    assert got_a == [chunk("a", 1), chunk("a", 3, "length")] and got_b == chunk("b", 2) and lost == []


def test_a_broken_stream_reaches_every_open_mailbox_and_later_ones():
    async def scenario():
        lost = []
        gate = asyncio.Event()

        async def breaking():
            await gate.wait()
            async for ref in _stream([[DecodeEnded("a", DecodeStatus.CANCELLED)]], RayActorError()):
                yield ref

        pump = DecodeEventPump("d", breaking(), lambda worker, error: lost.append(worker))
        a, b = pump.open("a"), pump.open("b")
        gate.set()
        events_a = [await a.get(), await a.get()]
        event_b = await b.get()
        late = await pump.open("c").get()
        return events_a, event_b, late, lost

    events_a, event_b, late, lost = asyncio.run(scenario())
    assert events_a[0] == DecodeEnded("a", DecodeStatus.CANCELLED)
    for event in (events_a[1], event_b, late):
        assert isinstance(event, WorkerStreamLost) and isinstance(event.error, RayActorError)
    assert lost == ["d"]
