"""A step's host <-> device copies, counted where they are made (engine/step_io.py): one upload of all its
inputs and one copy of its picks back, for decode steps (eager, or through the decode graphs' staged inputs) and
mixed steps alike; block tables travel as the entries that changed. Rows that sample differently (their parameters,
grammar masks, penalties, prompt logprobs): tests/engine/test_step_copies_sampling.py."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.attention.backends import triton_available
from engine.runner.decode_graphs import DecodeGraphs
from engine.step_io import LANDING_RING, LandingRing
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def copies_per_step(engine, steps: int, tokens: dict[str, list[int]]) -> list[tuple[int, int]]:
    """(host-to-device, device-to-host) copies of each of the next `steps` steps; their tokens go into `tokens`."""
    counts = []
    for _ in range(steps):
        engine.runner.io.copies.reset()
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        counts.append((engine.runner.io.copies.host_to_device, engine.runner.io.copies.device_to_host))
    return counts


def test_decode_and_mixed_steps_copy_once_each_way(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama")
    llm = make_llm(str(path), device="cpu", block_size=4)
    engine = llm.engine
    prompts = random_prompts([5, 9, 14], llm.get_tokenizer().vocab_size, seed=3)
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens = {}
    assert copies_per_step(engine, 3, tokens) == [(1, 1)] * 3  # the prefill, then decodes (a block every 4 tokens)
    engine.add_request("r2", prompts[2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))
    assert copies_per_step(engine, 2, tokens) == [(1, 1)] * 2  # a mixed step (with logprobs), then a decode step
    while engine.has_unfinished_requests():
        copies_per_step(engine, 1, tokens)
    assert [tokens[f"r{i}"] for i in range(3)] == hf_greedy(path, prompts, 8)
    assert_all_blocks_free(llm)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_graph_decode_step_copies_once_each_way(tiny_checkpoint, hf_greedy):
    """Decode graphs uncaptured (their staged inputs and replay path, eagerly): the step's rows and its table
    updates land in one upload, the tokens equal transformers'."""
    path = tiny_checkpoint("qwen2")
    llm = make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", max_num_seqs=4,
                   block_size=4, async_scheduling=False,  # a step's copies, step by step
                   max_num_batched_tokens=64, max_model_len=64)  # no default-sized step through the interpreter
    engine = llm.engine
    graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, engine.runner.attention, max_num_seqs=4,
                          max_model_len=engine.max_model_len, device=TEST_DEVICE, capture=False, io=engine.runner.io)
    engine.runner.decode_graphs = graphs
    replayed = []
    run = graphs.run_staged
    graphs.run_staged = lambda batch, *rest: replayed.append(len(batch.updates)) or run(batch, *rest)
    prompts = random_prompts([3, 6, 11], llm.get_tokenizer().vocab_size, seed=4)
    few = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)  # each row crosses into a new block
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, few)
    got = {}
    counts = []
    while engine.has_unfinished_requests():
        counts += copies_per_step(engine, 1, got)
    steps = 5  # one prefill step, then 4 decode steps
    assert counts == [(1, 1)] * steps
    assert len(replayed) == steps - 1 and 0 < sum(replayed) < 3 * (steps - 1)  # only new blocks travel
    assert [got[f"r{i}"] for i in range(3)] == hf_greedy(path, prompts, 5)
    assert_all_blocks_free(llm)


def test_landing_ring_takes_its_buffers_in_turn_from_the_first_copy():
    """The pinned buffers a CUDA step's picks land in (pin_memory off here): the first copy already has a buffer
    (the H100 run of session 22 found the first copy indexing past a ring that was still being filled), each of
    LANDING_RING buffers is taken once before one is reused, and a buffer too small for a copy is replaced."""
    ring = LandingRing(torch.int64, pin_memory=False)
    taken = [ring.next(4) for _ in range(2 * LANDING_RING)]
    assert len({id(buffer) for buffer in taken}) == LANDING_RING
    assert all(taken[i] is taken[i + LANDING_RING] for i in range(LANDING_RING))
    assert all(buffer.numel() >= 4 and buffer.dtype == torch.int64 for buffer in taken)
    grown = ring.next(5000)
    assert grown.numel() >= 5000 and grown is not taken[0]
