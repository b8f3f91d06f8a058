"""Chats through the coordinator on a real local Ray (1 prefill + 2 decode workers), KV over gloo, with
decoder-side prefix reuse, KV-aware routing and the `uncached` disaggregation policy (local_prefill_tokens
24); the same reuse over gRPC, worker to worker, is in test_decode_prefix_reuse.py (the coordinator's part
does not depend on the transport, and one cluster start is most of this test's time). Two conversations of
three turns run concurrently; each turn's prompt is the conversation so far (prompts and the answers actually streamed) plus a new user message:
- turn 1 ships the whole prompt; turn 2 goes to the decode worker that holds turn 1's blocks and ships only
  what it lacks (the bytes counted exactly, Timing.decode_cached_tokens says how many tokens it held);
- turn 3 leaves fewer than 24 tokens uncached on that worker, so the policy prefills it there (local, no KV);
- every turn's greedy tokens equal a colocated engine's, and every pool is whole at the end."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.metrics import ServingMetrics
from engine import LLM
from kv_transfer.control.connection import ControlConnection
from kv_transfer.control.handshake import HandshakeRefused, PeerHello, client_handshake
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle)
from tests.support.engine_checks import random_prompts

VOCAB = 256
BLOCK = 16
LOCAL_BELOW = 24
OUTPUT = 8
FIRST, SECOND, THIRD = 150, 30, 5   # the first prompt and the two user messages after it


@pytest.fixture(scope="module")
def chat_cluster():
    config = dataclasses.replace(cluster_config(1, 2, "gloo"), local_prefill_tokens=LOCAL_BELOW)
    assert config.disagg_policy == "uncached" and config.decode_prefix_reuse
    with running_cluster(config) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated():
    return LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)


async def converse(coordinator, name: str, messages: list[list[int]]) -> list[tuple[list[int], list[int], object]]:
    """The turns of one conversation, one after the other: (prompt, tokens, final Timing) per turn."""
    history, turns = [], []
    for index, message in enumerate(messages):
        prompt = history + message
        tokens, last = await collect(coordinator, request(f"{name}-{index}", prompt, greedy(OUTPUT)))
        turns.append((prompt, tokens, last.timing))
        history = prompt + tokens
    return turns


def test_chat_turns_ship_only_what_their_decode_worker_lacks_and_equal_colocated(chat_cluster, colocated):
    drawn = random_prompts([FIRST, SECOND, THIRD] * 2, VOCAB, seed=41)
    conversations = {"a": drawn[:3], "b": drawn[3:]}

    async def run():
        results = await asyncio.gather(*(converse(chat_cluster, n, m) for n, m in conversations.items()))
        await wait_until_idle(chat_cluster)
        return results

    for turns in asyncio.run(run()):
        (prompt1, tokens1, t1), (prompt2, tokens2, t2), (prompt3, tokens3, t3) = turns
        for prompt, tokens in ((prompt1, tokens1), (prompt2, tokens2), (prompt3, tokens3)):
            want = colocated.generate(prompt_token_ids=[prompt], sampling_params=greedy(OUTPUT), use_tqdm=False)
            assert tokens == want[0].outputs[0].token_ids, f"a {len(prompt)}-token turn differs from colocated"
        assert t1.decode_worker == t2.decode_worker == t3.decode_worker, "a turn left its conversation's worker"
        assert (t1.prefill_location, t1.decode_cached_tokens) == ("remote", 0)
        block_nbytes = t1.kv_bytes // -(-FIRST // BLOCK)
        held = (len(prompt1) + OUTPUT - 1) // BLOCK        # prompt 1's blocks and those its answer completed
        assert (t2.prefill_location, t2.decode_cached_tokens) == ("remote", held * BLOCK)
        assert t2.kv_bytes == (-(-len(prompt2) // BLOCK) - held) * block_nbytes
        assert t2.kv_bytes * 2 < -(-len(prompt2) // BLOCK) * block_nbytes   # less than half the whole prompt
        assert len(prompt3) - (len(prompt2) + OUTPUT - 1) // BLOCK * BLOCK < LOCAL_BELOW
        assert (t3.prefill_location, t3.prefill_worker, t3.kv_bytes) == ("local", "", 0)


def test_strangers_on_the_kv_plane_are_dropped_counted_and_serving_goes_on(chat_cluster):
    """The cluster's KV plane is closed (issue 32): a decode worker's control listener drops garbage and a
    sender without the cluster secret before reading anything else, counts both (its stats, so /health and
    /metrics), and the cluster serves the next request as before."""
    decode = next(info for info in chat_cluster.workers.values() if info.role == "decode")
    host, _, port = decode.kv_address.target.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as stranger:
        stranger.sendall(os.urandom(4096))
        try:
            assert stranger.recv(1) == b"", "the KV listener answered garbage"
        except ConnectionResetError:
            pass  # closed with the garbage unread
    conn = ControlConnection(socket.create_connection((host, int(port)), timeout=10))
    with pytest.raises(HandshakeRefused):
        client_handshake(conn, None, PeerHello("another-cluster", 0, 0), time.monotonic() + 10)
    conn.close()
    tokens, _ = asyncio.run(collect(chat_cluster, request("after-strangers", list(range(1, 60)), greedy(4))))
    assert len(tokens) == 4
    deadline = time.monotonic() + 10
    while True:
        health = asyncio.run(chat_cluster.health())
        if health.details["workers"][decode.name].get("dropped_connections") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert health.details["workers"][decode.name]["dropped_connections"] == 2, health.details["workers"]
    gauges = {s.labels["worker"]: s.value for family in text_string_to_metric_families(
        ServingMetrics().render(health).decode()) for s in family.samples
        if s.name == "tandem_worker_dropped_connections"}
    assert gauges[decode.name] == 2, gauges
    asyncio.run(wait_until_idle(chat_cluster))
