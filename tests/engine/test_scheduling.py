"""Batching, chunking, prefix caching and preemption change how work is done, never the output."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 16, 17, 50, 129, 260]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama3"))


def greedy_tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def prefill_kv(llm: LLM, prompts) -> list[torch.Tensor]:
    """Prefill-only requests: the first token, and the prompt's K/V read out of the pool."""
    engine, kv = llm.engine, llm.engine.kv_cache.kv
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, GREEDY, prefill_only=True)
    results = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = delta
    kv_per_prompt = []
    for i, prompt in enumerate(prompts):
        blocks = torch.tensor(results[f"p{i}"].kv_block_ids)
        # [layers, 2, blocks * block_size, kv_heads, head_dim] -> the prompt's token slots
        per_token = kv[:, :, blocks].flatten(2, 3)[:, :, :len(prompt)]
        kv_per_prompt.append((results[f"p{i}"].new_token_ids[0], per_token.clone()))
        assert engine.release_prefilled(f"p{i}")
    return kv_per_prompt


def test_packed_prefill_equals_prefilling_each_alone(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=4096)
    prompts = random_prompts(LENGTHS, 300, seed=2)
    packed = prefill_kv(llm, prompts)
    assert llm.engine.stats.num_steps == 1, "all prompts should go through one packed forward"
    for prompt, (token, kv) in zip(prompts, packed):
        [(alone_token, alone_kv)] = prefill_kv(llm, [prompt])
        assert token == alone_token
        torch.testing.assert_close(kv, alone_kv, rtol=1e-5, atol=1e-5)
    assert_all_blocks_free(llm)


def test_chunked_prefill_of_7_tokens_equals_whole(ckpt):
    prompts = random_prompts(LENGTHS, 300, seed=3)
    whole = make_llm(ckpt, max_num_batched_tokens=4096)
    chunked = make_llm(ckpt, max_num_batched_tokens=7)
    assert greedy_tokens(chunked, prompts) == greedy_tokens(whole, prompts)
    assert chunked.engine.stats.num_steps > whole.engine.stats.num_steps
    assert_all_blocks_free(whole)
    assert_all_blocks_free(chunked)


def test_long_prefill_threshold_lets_short_prompts_into_the_same_step_same_output(ckpt):
    long_prompt, short_prompt = random_prompts([200, 5], 300, seed=4)
    capped = make_llm(ckpt, max_num_batched_tokens=512, long_prefill_token_threshold=32)
    engine = capped.engine
    engine.add_request("long", long_prompt, GREEDY, prefill_only=True)
    engine.add_request("short", short_prompt, GREEDY, prefill_only=True)
    first_step = {delta.request_id for delta in engine.step()}
    assert first_step == {"short"}, "the short prompt should finish its prefill in the first step"
    assert engine.get_sequence("long").num_computed_tokens == 32
    for request_id in ("long", "short"):
        engine.abort(request_id)
    prompts = random_prompts(LENGTHS, 300, seed=5)
    whole = make_llm(ckpt, max_num_batched_tokens=4096)
    assert greedy_tokens(capped, prompts) == greedy_tokens(whole, prompts)
    assert_all_blocks_free(capped)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_llm(ckpt, long_prefill_token_threshold=-1)


def _step_kinds(engine) -> tuple[set[str], set[str]]:
    """One step: (the requests that computed prompt tokens in it, those that decoded a token in it)."""
    before = {rid: (seq.num_computed_tokens, seq.num_prompt_tokens)
              for rid in ("a", "b", "late", "later", "longer", "d", "e") if (seq := engine.get_sequence(rid)) is not None}
    engine.step()
    prompts, decodes = set(), set()
    for rid, (computed, prompt_len) in before.items():
        seq = engine.get_sequence(rid)
        if seq is not None and seq.num_computed_tokens > computed:
            (prompts if computed < prompt_len else decodes).add(rid)
    return prompts, decodes


def test_prefill_first_gives_a_short_new_prompt_its_own_step_then_serves_the_decodes(ckpt):
    a, b, late, later, longer = random_prompts([20, 30, 8, 2, 17], 300, seed=21)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = make_llm(ckpt, max_num_batched_tokens=512, prefill_first="on")
    engine = first.engine
    engine.add_request("a", a, params)
    engine.add_request("b", b, params)
    assert _step_kinds(engine) == ({"a", "b"}, set())    # nothing decodes yet: one ordinary step
    engine.add_request("late", late, params)
    assert _step_kinds(engine) == ({"late"}, set())      # 8 tokens, 2 decodes: alone, ahead of a and b
    engine.add_request("later", later, params)
    assert _step_kinds(engine) == ({"later"}, {"a", "b", "late"})  # never two prompt steps in a row: mixed
    engine.add_request("longer", longer, params)         # 17 tokens, over 4 a decode: mixed, they ride along
    assert _step_kinds(engine) == ({"longer"}, {"a", "b", "late", "later"})
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(first)
    chunking = make_llm(ckpt, max_num_batched_tokens=512, long_prefill_token_threshold=8, prefill_first="on")
    chunking.engine.add_request("a", a, params, prefill_only=True)  # a prefill worker: nothing decodes
    assert _step_kinds(chunking.engine) == ({"a"}, set())
    chunking.engine.add_request("late", late, params, prefill_only=True)
    assert _step_kinds(chunking.engine) == ({"a", "late"}, set())  # packed beside a's next chunk, not ahead
    while chunking.engine.has_unfinished_requests():
        chunking.engine.step()
    for request_id in ("a", "late"):
        assert chunking.engine.release_prefilled(request_id)
    d, e, uncached = random_prompts([5, 4, 20], 300, seed=23)
    chunking.engine.add_request("d", d, params)
    assert _step_kinds(chunking.engine) == ({"d"}, set())
    chunking.engine.add_request("b", uncached, params)  # 20 tokens: 3 chunks of 8, no step of its own
    assert _step_kinds(chunking.engine) == ({"b"}, {"d"})
    chunking.engine.add_request("e", e, params)  # one chunk finishes it, 4 tokens to d's decode: its own step
    assert _step_kinds(chunking.engine) == ({"e"}, set())
    while chunking.engine.has_unfinished_requests():
        chunking.engine.step()
    assert_all_blocks_free(chunking)
    mixed = make_llm(ckpt, max_num_batched_tokens=512, prefill_first="off")
    mixed.engine.add_request("a", a, params)
    mixed.engine.add_request("b", b, params)
    _step_kinds(mixed.engine)
    mixed.engine.add_request("late", late, params)
    assert _step_kinds(mixed.engine) == ({"late"}, {"a", "b"})
    while mixed.engine.has_unfinished_requests():
        mixed.engine.step()
    prompts = random_prompts(LENGTHS, 300, seed=22)
    assert greedy_tokens(make_llm(ckpt, prefill_first="on"), prompts) == greedy_tokens(mixed, prompts)
    with pytest.raises(ValueError, match="prefill_first"):
        make_llm(ckpt, prefill_first="sometimes")


def test_prefill_first_is_on_for_cpu_and_off_for_cuda_by_default():
    from engine.config import EngineConfig
    from engine.core.scheduler import prefill_first_enabled
    assert prefill_first_enabled(EngineConfig(), "cpu") and not prefill_first_enabled(EngineConfig(), "cuda")
    assert prefill_first_enabled(EngineConfig(prefill_first="on"), "cuda")
    assert not prefill_first_enabled(EngineConfig(prefill_first="off"), "cpu")


def test_prefix_cache_hit_computes_fewer_tokens_same_output(ckpt):
    block = 16
    shared = random_prompts([5 * block], 300, seed=4)[0]
    first, second = shared + [7, 8, 9], shared + [10, 11]
    cached = make_llm(ckpt, block_size=block)
    uncached = make_llm(ckpt, block_size=block, enable_prefix_caching=False)
    assert greedy_tokens(cached, [first]) == greedy_tokens(uncached, [first])
    before = cached.engine.stats.num_prefill_tokens
    out = cached.generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    computed = cached.engine.stats.num_prefill_tokens - before
    assert computed == len(second) - 5 * block, "the 5 shared full blocks must come from the cache"
    assert out.metrics.num_cached_tokens == 5 * block
    assert out.outputs[0].token_ids == greedy_tokens(uncached, [second])[0]
    assert_all_blocks_free(cached)
    assert_all_blocks_free(uncached)


def test_identical_prompt_reuses_all_but_the_last_token(ckpt):
    llm = make_llm(ckpt, block_size=4)
    prompt = random_prompts([32], 300, seed=5)[0]
    first = greedy_tokens(llm, [prompt])
    before = llm.engine.stats.num_prefill_tokens
    assert greedy_tokens(llm, [prompt]) == first
    # 31 tokens fit 7 full blocks (28 tokens): the last 4 are recomputed to get the logits.
    assert llm.engine.stats.num_prefill_tokens - before == 4
    assert_all_blocks_free(llm)


def test_preemption_by_recompute_gives_same_output(ckpt):
    prompts = random_prompts([40, 45, 50, 55, 60, 65], 300, seed=6)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_llm(ckpt, block_size=8)
    tight = make_llm(ckpt, block_size=8, num_kv_blocks=32, enable_prefix_caching=False)
    assert greedy_tokens(tight, prompts, params) == greedy_tokens(roomy, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0, "the small pool must force preemption"
    assert_all_blocks_free(tight)
    assert_all_blocks_free(roomy)


def test_seeded_sampling_is_reproducible_across_batches(ckpt):
    llm = make_llm(ckpt)
    prompts = random_prompts([12, 30, 70], 300, seed=7)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    alone = greedy_tokens(llm, prompts[:1], seeded)[0]
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=[seeded, other, other])
    assert batched[0].outputs[0].token_ids == alone
    reseeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=124, ignore_eos=True)
    assert greedy_tokens(llm, prompts[:1], reseeded)[0] != alone
    assert_all_blocks_free(llm)


def test_top_k_1_is_greedy(ckpt):
    llm = make_llm(ckpt)
    prompts = random_prompts([20, 33], 300, seed=8)
    top1 = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    assert greedy_tokens(llm, prompts, top1) == greedy_tokens(llm, prompts)
    assert_all_blocks_free(llm)
