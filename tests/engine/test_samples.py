"""n samples of one prompt (SamplingParams.n) in the engine: the prompt is prefilled once and its full blocks
shared by reference (the partial last block copied), and every sample is what a request of its own would
give: seeded samples j equal single requests with seed + j (tokens and logprobs), greedy ones transformers'
greedy tokens; under preemption too; aborting frees every block."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm

BLOCK = 8
VOCAB = 300


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(str(ckpt), block_size=BLOCK) as llm:
        yield llm


def seeded(n: int, seed: int = 11, **extra) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=10, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **extra)


def test_seeded_samples_equal_single_requests_with_seed_plus_j(llm):
    prompts = random_prompts([2 * BLOCK, 2 * BLOCK + 3, 5], VOCAB, seed=3)  # whole blocks, a partial one, one
    together = llm.generate(prompt_token_ids=prompts, sampling_params=seeded(4, logprobs=2), use_tqdm=False)
    for prompt, output in zip(prompts, together):
        assert [c.index for c in output.outputs] == [0, 1, 2, 3]
        for j, sample in enumerate(output.outputs):
            alone = llm.generate(prompt_token_ids=[prompt], sampling_params=seeded(1, seed=11 + j, logprobs=2),
                                 use_tqdm=False)[0].outputs[0]
            assert (sample.token_ids, sample.text, sample.finish_reason) == (alone.token_ids, alone.text, "length")
            for got, want in zip(sample.logprobs, alone.logprobs):
                assert got.keys() == want.keys()
                assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # they are distinct samples
    assert_all_blocks_free(llm)


def test_greedy_samples_are_transformers_greedy(ckpt, llm, hf_greedy):
    prompts = random_prompts([13, 24], VOCAB, seed=4)
    expected = hf_greedy(ckpt, prompts, 8)
    params = SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e] * 3 for e in expected]
    assert_all_blocks_free(llm)


def test_the_prompt_is_prefilled_once_and_its_full_blocks_shared(ckpt):
    llm = make_llm(str(ckpt), block_size=BLOCK, enable_prefix_caching=False)
    engine, allocator = llm.engine, llm.engine.kv_cache.allocator
    prompt = random_prompts([3 * BLOCK + 5], VOCAB, seed=5)[0]
    engine.add_request("r", prompt, seeded(4))
    first = engine.step()  # the prefill: every sample's first token
    assert sorted(d.index for d in first) == [0, 1, 2, 3]
    assert engine.stats.num_prefill_tokens == len(prompt)  # once, not 4 times
    tables = [seq.block_table for seq in engine.scheduler.running]
    assert len(tables) == 4 and all(t[:3] == tables[0][:3] for t in tables)  # the 3 full blocks, shared
    assert [allocator.ref_count(b) for b in tables[0][:3]] == [4, 4, 4]
    assert len({t[3] for t in tables}) == 4  # the partial block: a copy each
    assert engine.num_total_blocks - engine.num_free_blocks == 3 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_samples_survive_preemption_and_abort_frees_everything(ckpt):
    """A pool of 10 blocks for 4 samples that each need 5: samples get preempted and recompute, and still
    equal single requests; an abort mid-way frees every block."""
    small = make_llm(str(ckpt), block_size=BLOCK, num_kv_blocks=10)
    prompt = random_prompts([2 * BLOCK + 4], VOCAB, seed=6)[0]
    params = SamplingParams(n=4, max_tokens=18, temperature=0.8, seed=21, ignore_eos=True)
    output = small.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert small.engine.scheduler.num_preemptions > 0
    for j, sample in enumerate(output.outputs):
        alone = small.generate(prompt_token_ids=[prompt], sampling_params=params.for_sample(j), use_tqdm=False)
        assert sample.token_ids == alone[0].outputs[0].token_ids
    small.engine.add_request("a", prompt, params)
    for _ in range(3):
        small.engine.step()
    assert small.engine.abort("a") and not small.engine.has_unfinished_requests()
    assert_all_blocks_free(small)


def test_a_sample_without_a_block_for_its_copy_waits_and_recomputes(ckpt):
    """3 blocks hold the prompt (2 full, 1 partial) and nothing else: the other samples cannot copy the
    partial block, wait without blocks, and recompute after sample 0 (through the prefix cache)."""
    tight = make_llm(str(ckpt), block_size=BLOCK, num_kv_blocks=3)
    prompt = random_prompts([2 * BLOCK + 4], VOCAB, seed=7)[0]
    params = SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=21, ignore_eos=True, prompt_logprobs=1)
    tight.engine.add_request("t", prompt, params)
    first = tight.engine.step()
    assert sorted(d.index for d in first) == [0, 1, 2]
    assert all(len(d.prompt_logprobs) == len(prompt) for d in first)  # computed once, every sample gets them
    assert [(s.index, s.block_table) for s in tight.engine.scheduler.waiting] == [(1, []), (2, [])]
    tokens = {0: [], 1: [], 2: []}
    for delta in first:
        tokens[delta.index] += delta.new_token_ids
    while tight.engine.has_unfinished_requests():
        for delta in tight.engine.step():
            tokens[delta.index] += delta.new_token_ids
    for j in range(3):
        alone = tight.generate(prompt_token_ids=[prompt], sampling_params=params.for_sample(j), use_tqdm=False)
        assert tokens[j] == alone[0].outputs[0].token_ids
    assert_all_blocks_free(tight)


def test_n_is_checked():
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    assert SamplingParams(n=3, seed=2 ** 63 - 1).for_sample(2).seed == 1  # seed + j, wrapped into int64
