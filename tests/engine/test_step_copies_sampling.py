"""A step's copies when its rows sample differently: per-row temperature / top-k / top-p / min-p, seeds, penalties,
logit bias, min_tokens, a grammar's token mask, logprobs and prompt logprobs all cross in the step's one upload and
come back in its one copy (engine/step_io.py counts them), eager and through the decode graphs' staged
inputs; greedy rows still equal transformers, seeded rows draw what they draw in any other batch."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams, StructuredOutputsParams
from engine.attention.backends import triton_available
from engine.runner.decode_graphs import DecodeGraphs, staged_layout
from engine.step_io import StagingBuffer
from engine.sampling.sampler import Sampler
from tests.engine.test_step_copies import copies_per_step
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)
MIXED = [GREEDY, SEEDED,
         SamplingParams(max_tokens=6, temperature=1.3, top_k=10, min_p=0.05, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.4, frequency_penalty=0.3,
                        presence_penalty=0.2, logit_bias={5: 2.0}, min_tokens=4, stop_token_ids=[7], seed=2),
         SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)]
CHOICE = SamplingParams(max_tokens=30, temperature=0.9, seed=4,
                        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))


def run_counted(engine, prompts, params) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
    """Adds one request per prompt and steps to the end; the copies of every step and each request's tokens."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    tokens, counts = {}, []
    while engine.has_unfinished_requests():
        counts += copies_per_step(engine, 1, tokens)
    return counts, tokens


def test_a_step_of_rows_that_sample_differently_copies_once_each_way(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama")
    llm = make_llm(str(path), device="cpu", block_size=4, async_scheduling=False)
    prompts = random_prompts([5, 9, 14, 7, 6, 8], llm.get_tokenizer().vocab_size, seed=3)
    counts, tokens = run_counted(llm.engine, prompts, MIXED + [CHOICE])
    assert counts == [(1, 1)] * len(counts) and len(counts) >= 6  # the prefill, then mixed decode steps
    assert [tokens["r0"], tokens["r4"]] == hf_greedy(path, [prompts[0], prompts[4]], 6)
    assert_all_blocks_free(llm)
    _, again = run_counted(llm.engine, [prompts[1]], [SEEDED])
    assert again["r0"] == tokens["r1"]  # a seeded row draws the same whatever shares its steps
    llm.close()


def test_a_prompt_chunk_that_samples_nothing_brings_its_prompt_logprobs_back_in_one_copy(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = make_llm(str(path), device="cpu", block_size=4, max_num_batched_tokens=8, async_scheduling=False)
    prompt = random_prompts([20], llm.get_tokenizer().vocab_size, seed=5)[0]
    counts, _ = run_counted(llm.engine, [prompt], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)])
    assert counts == [(1, 1)] * len(counts) and len(counts) == 4  # 3 prefill chunks (8 + 8 + 4), 1 decode
    output = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(output.prompt_logprobs) == 20 and output.prompt_logprobs[0] is None
    assert all(len(entry) in (1, 2) for entry in output.prompt_logprobs[1:])
    llm.close()


GRAPH_ROWS = 5  # the graphs' largest batch: the five rows of MIXED, no padding row to run through the interpreter


def graph_llm(path, cramped: bool = False):
    """An engine whose decode steps go through uncaptured decode graphs (their staged inputs, eagerly); cramped:
    their staging buffer holds their own fields and 5 table updates, no more. A small step budget and context
    (the prompts are short): the engine starts without pushing a default-sized step through the interpreter."""
    llm = make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton",
                   max_num_seqs=GRAPH_ROWS, block_size=4, async_scheduling=False, max_num_batched_tokens=64,
                   max_model_len=64)
    engine = llm.engine
    engine.runner.decode_graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, engine.runner.attention,
                                               max_num_seqs=GRAPH_ROWS, max_model_len=engine.max_model_len,
                                               device=TEST_DEVICE, capture=False, io=engine.runner.io)
    if cramped:
        graphs = engine.runner.decode_graphs
        graphs.staging = StagingBuffer(staged_layout(GRAPH_ROWS, 5)[1], TEST_DEVICE, engine.runner.io.copies)
    return llm


@pytest.fixture(scope="module")
def roomy_graph_run(tiny_checkpoint):
    """MIXED's five prompts through a graph engine with a roomy staging buffer: (path, prompts, engine, the copies
    of every step, each request's tokens). Shared by the two tests below; it ends with every block free."""
    path = tiny_checkpoint("qwen2")
    with graph_llm(path) as llm:
        prompts = random_prompts([3, 6, 11, 4, 5], llm.get_tokenizer().vocab_size, seed=4)
        counts, tokens = run_counted(llm.engine, prompts, MIXED)
        yield path, prompts, llm, counts, tokens


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_graph_decode_step_of_rows_that_sample_differently_copies_once_each_way(roomy_graph_run, hf_greedy):
    """The sampling inputs are written behind the graphs' own fields: the graphs' one upload carries them."""
    path, prompts, llm, counts, tokens = roomy_graph_run
    assert counts == [(1, 1)] * 6  # one prefill step, then 5 decode steps
    assert [tokens["r0"], tokens["r4"]] == hf_greedy(path, [prompts[0], prompts[4]], 6)
    assert_all_blocks_free(llm)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_sampling_inputs_too_big_for_the_graphs_buffer_take_a_copy_of_their_own(roomy_graph_run):
    path, prompts, _, _, roomy = roomy_graph_run
    with graph_llm(path, cramped=True) as llm:
        counts, cramped = run_counted(llm.engine, prompts, MIXED)
        assert_all_blocks_free(llm)
    assert counts[0] == (1, 1) and counts[1:] == [(2, 1)] * 5  # the decode steps: the graphs' upload + their own
    assert cramped == roomy


def test_a_sampler_on_its_own_uploads_only_what_differs_between_rows():
    """Outside a step, the sampler's inputs go in one upload of their own; rows that share their parameters (the
    common case) send nothing: every shared value stays a scalar."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0))
    shared = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=2)
    sampler = Sampler(0)
    copies = sampler.io_for(logits.device).copies
    picks = sampler.sample(logits, [shared] * 4, [5, 6, 7, 8])
    assert (copies.host_to_device, len(picks.tokens)) == (0, 4)
    seeded = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=2, seed=3)
    mixed = [seeded, SamplingParams(temperature=1.3, top_k=5, top_p=0.5, min_p=0.1, logprobs=2, seed=3)] * 2
    again = sampler.sample(logits, mixed, [5, 6, 7, 8], [([1, 2, 3], 1)] * 4)
    assert copies.host_to_device == 1
    assert again.tokens[0] == Sampler(1).sample(logits[:1], [seeded], [5]).tokens[0]  # whatever its batch


def test_a_grammar_bitmask_is_filled_straight_into_the_step_staging_buffer(tiny_checkpoint):
    """The filler writes the constrained rows' bitmask in place in the staged upload (no bitmask built on the host and
    copied in after): the array it is handed is a view of the runner's staging bytes."""
    import numpy as np

    llm = make_llm(str(tiny_checkpoint("llama")), device="cpu", block_size=4, async_scheduling=False)
    prompt = random_prompts([6], llm.get_tokenizer().vocab_size, seed=8)[0]
    run_counted(llm.engine, [prompt], [CHOICE])  # the first constrained request makes the filler
    sampler, runner = llm.engine.runner.sampler, llm.engine.runner
    inner, seen = sampler.mask_filler, []

    class Spy:
        words = inner.words

        def fill_into(self, grammars, out):
            buffers = [runner.io.staging] + ([runner.decode_graphs.staging] if runner.decode_graphs else [])
            seen.append(any(np.shares_memory(out, b._host_bytes) for b in buffers))
            inner.fill_into(grammars, out)

    sampler.mask_filler = Spy()
    counts, tokens = run_counted(llm.engine, [prompt], [CHOICE])
    assert seen and all(seen) and counts == [(1, 1)] * len(counts)
    assert llm.get_tokenizer().decode(tokens["r0"]).strip() in ("red", "green", "blue")
    assert_all_blocks_free(llm)
    llm.close()
