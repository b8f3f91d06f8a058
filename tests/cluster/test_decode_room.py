"""Waiting for room on the decode side: RoomQueue (first come first served, only the head asks again) and
DecodeAdmissions over workers scripted to refuse for lack of room, then a real 1P1D cluster whose decode worker takes
one request at a time."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
import types
from contextlib import aclosing

import pytest

from cluster.backend import BackendOverloaded, BackendUnavailable
from cluster.coordinator.decode_admission import DecodeAdmissions
from cluster.coordinator.room_queue import RoomQueue
from cluster.coordinator.routing import Router
from cluster.serve import add_arguments, config_from_args
from cluster.serve_config import cluster_config as serve_cluster_config
from decode_worker import Admission, ExpectedRequest
from decode_worker.admission import AdmissionControl
from engine import LLM, SamplingParams
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle)
from tests.support.engine_checks import random_prompts

NO_DEADLINE = float("inf")
FULL = Admission(False, "KV pool full: 0 blocks free", for_room=True)
STOPPING = Admission(False, "the decode worker is stopping")


def test_the_room_queue_serves_in_arrival_order_and_only_the_head_is_woken():
    async def scenario():
        queue, order = RoomQueue(), []

        async def waiter(name: str, admitted: asyncio.Event):
            async with queue.joined() as turn:
                while await turn(NO_DEADLINE):
                    if admitted.is_set():  # the test's stand-in for "the workers took it"
                        order.append(name)
                        return

        rooms = {name: asyncio.Event() for name in "abc"}
        tasks = [asyncio.ensure_future(waiter(name, rooms[name])) for name in "abc"]
        await asyncio.sleep(0.01)
        assert len(queue) == 3
        rooms["c"].set(), rooms["b"].set()  # room for the later two only: the head asks on, nobody passes it
        queue.notify()
        await asyncio.sleep(0.25)  # the head rechecks (ROOM_RECHECK_S) and is still refused
        assert order == [] and len(queue) == 3
        rooms["a"].set()
        queue.notify()
        await asyncio.gather(*tasks)
        return order, len(queue)

    assert asyncio.run(scenario()) == (["a", "b", "c"], 0)


def test_a_waiter_past_its_deadline_or_cancelled_leaves_and_the_next_moves_up():
    async def scenario():
        queue, turns = RoomQueue(), []

        async def hold_the_head():
            async with queue.joined() as turn:
                while await turn(NO_DEADLINE):  # asks again and again, never admitted
                    pass

        async def wait_once(deadline: float):
            async with queue.joined() as turn:
                turns.append(await turn(deadline))

        head = asyncio.ensure_future(hold_the_head())
        await asyncio.sleep(0)
        await wait_once(time.monotonic() - 1)  # already past its deadline: False, and it leaves
        last = asyncio.ensure_future(wait_once(NO_DEADLINE))
        await asyncio.sleep(0.01)
        head.cancel()  # its client left while it waited
        await last  # now the head: woken at once by the one that left
        assert head.cancelled()
        return turns, len(queue)

    assert asyncio.run(scenario()) == ([False, True], 0)


def test_a_decode_worker_marks_which_refusals_room_can_lift():
    free = list(range(4))  # a pool of 4 blocks of 16 tokens

    def take(count: int) -> list[int] | None:
        return [free.pop() for _ in range(count)] if count <= len(free) else None

    control = AdmissionControl(16, lambda: len(free), take, free.extend, max_live_requests=2, headroom_blocks=1)
    assert control.reserve("a", [1] * 40).accepted                     # 3 blocks, 1 left
    full = control.reserve("b", [1] * 17)                              # needs 2 + 1 headroom
    assert not full.accepted and full.for_room and "KV pool full" in full.reason
    duplicate = control.reserve("a", [1])
    assert not duplicate.accepted and not duplicate.for_room
    control.release("a")
    assert control.reserve("b", [1]).accepted and control.reserve("c", [1]).accepted
    at_limit = control.reserve("d", [1])
    assert not at_limit.accepted and at_limit.for_room and "the limit is 2" in at_limit.reason
    control.close()
    stopping = control.reserve("e", [1])
    assert not stopping.accepted and not stopping.for_room


class ScriptedWorkers:
    """A WorkerSet stand-in: each decode worker answers expect() from its script (the last answer repeats)."""

    def __init__(self, scripts: dict[str, list[Admission]]):
        self.scripts, self.asked = scripts, []
        self.workers = {name: types.SimpleNamespace(actor=None) for name in scripts}

    def pump(self, name: str, on_lost):
        workers = self

        class Pump:
            def open(self, request_id: str) -> asyncio.Queue:
                return asyncio.Queue()

            async def expect(self, expected: ExpectedRequest) -> Admission:
                workers.asked.append((name, expected.request_id))
                script = workers.scripts[name]
                return script.pop(0) if len(script) > 1 else script[0]

        return Pump()

    def close_mailbox(self, name: str, request_id: str) -> None:
        pass


def admissions(scripts: dict[str, list[Admission]], room_wait_s: float) -> tuple[DecodeAdmissions, ScriptedWorkers]:
    workers = ScriptedWorkers(scripts)
    router = Router(["prefill-0"], {name: 64 for name in scripts}, block_size=16)
    lost = lambda name, error: None  # noqa: E731
    return DecodeAdmissions(router, workers, False, lost, lost, room_wait_s=room_wait_s), workers


def expected(request_id: str) -> ExpectedRequest:
    return ExpectedRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=4))


def test_a_request_refused_for_room_waits_and_is_admitted_when_a_request_ends():
    async def scenario():
        decoders, workers = admissions({"decode-0": [Admission(True), FULL, FULL, Admission(True)],
                                        "decode-1": [STOPPING]}, room_wait_s=30)  # a stopping one: no room there
        await decoders.open(expected("earlier"), blocks=1, queued=0)
        waiting = asyncio.ensure_future(decoders.open(expected("late"), blocks=1, queued=0))
        await asyncio.sleep(0.01)
        waited = decoders.waiting_for_room  # what health() reports
        decoders.release("decode-0", "earlier", 1, 0)  # it ended there: the head asks again
        worker, _, admission = await asyncio.wait_for(waiting, 10)
        return admission.accepted and (waited, decoders.waiting_for_room) == (1, 0), workers.asked

    accepted, asked = asyncio.run(scenario())
    assert accepted and [entry for entry in asked if entry[0] == "decode-0"] == \
        [("decode-0", "earlier")] + [("decode-0", "late")] * 3


def test_refusals_not_for_room_and_a_zero_wait_answer_at_once():
    async def scenario():
        stopping, _ = admissions({"decode-1": [STOPPING]}, room_wait_s=30)
        with pytest.raises(BackendOverloaded, match="stopping"):
            await asyncio.wait_for(stopping.open(expected("a"), 1, 0), 10)
        at_once, workers = admissions({"decode-0": [FULL]}, room_wait_s=0)
        with pytest.raises(BackendOverloaded, match=r"refused the request: decode-0: KV pool full"):
            await asyncio.wait_for(at_once.open(expected("b"), 1, 0), 10)
        return workers.asked

    assert asyncio.run(scenario()) == [("decode-0", "b")]


def test_a_request_that_finds_no_room_within_the_wait_is_refused_as_overloaded():
    async def scenario():
        decoders, workers = admissions({"decode-0": [FULL]}, room_wait_s=0.3)
        with pytest.raises(BackendOverloaded, match=r"after waiting 0.3 s for room\): decode-0: KV pool full"):
            await decoders.open(expected("a"), 1, 0)
        assert len(workers.asked) >= 2  # at once, then at least one recheck at the head
        dead, _ = admissions({}, room_wait_s=30)
        with pytest.raises(BackendUnavailable):
            await dead.open(expected("b"), 1, 0)

    asyncio.run(scenario())


def test_the_room_wait_is_a_serve_flag_and_a_cluster_setting_checked_at_the_boundary():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--replicas", "2", "--decode-room-wait-s", "2.5"]))
    assert serve_cluster_config(config).decode_room_wait_s == 2.5
    assert serve_cluster_config(config_from_args(parser.parse_args(["--replicas", "2"]))).decode_room_wait_s == 30
    with pytest.raises(ValueError, match="--decode-room-wait-s must be >= 0"):
        config_from_args(parser.parse_args(["--replicas", "2", "--decode-room-wait-s", "-1"]))
    with pytest.raises(ValueError, match="decode_room_wait_s must be >= 0"):
        dataclasses.replace(cluster_config(1, 1), decode_room_wait_s=float("nan"))


def test_a_decode_worker_that_takes_one_request_at_a_time_serves_every_concurrent_request():
    """Four requests at once to a decode worker with room for one live request: three wait for room in turn
    (not a 429), each is served, token for token as the colocated engine, and every pool ends whole."""
    prompts = random_prompts([12, 40, 7, 25], 256, seed=31)
    colocated = LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)
    outs = colocated.generate(prompt_token_ids=prompts, sampling_params=greedy(12), use_tqdm=False)
    config = dataclasses.replace(cluster_config(1, 1), max_live_per_decode_worker=1)

    async def run_all(coordinator):
        results = await asyncio.gather(*(collect(coordinator, request(f"room-{i}", prompt, greedy(12)))
                                         for i, prompt in enumerate(prompts)))
        await wait_until_idle(coordinator)
        async with aclosing(coordinator.generate(request("after", prompts[0], greedy(2)))) as chunks:
            tail = [chunk async for chunk in chunks]
        return results, tail

    with running_cluster(config) as coordinator:
        results, tail = asyncio.run(run_all(coordinator))
    assert [tokens for tokens, _ in results] == [out.outputs[0].token_ids for out in outs]
    assert sum(len(chunk.token_ids) for chunk in tail) == 2
