"""Logprobs against transformers: the sampled token's logprob, its rank and the top alternatives equal
log_softmax of transformers' logits for the same tokens (after the same processors and temperature)
within 1e-4 in float32, greedy and sampled; they follow the first token from a prefill-only engine to a
decode engine and across a resume without a duplicate or a gap; the offline shape is vLLM's. Every test
ends with every KV block free."""
from __future__ import annotations

import pytest
import torch

from engine import Logprob, SamplingParams, TokenLogprobs
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm
from tests.support.factories import load_hf_model
from tests.support.hf_processors import hf_generate, hf_processors

MAX_TOKENS = 10
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(str(ckpt)) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return load_hf_model(ckpt)


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int], params: SamplingParams,
                            eos_ids) -> torch.Tensor:
    """[len(tokens), vocab]: transformers' logits of each generated position (one forward over prompt +
    tokens), through the same processors with that position's history, over the temperature
    (greedy: 1), log_softmax."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()  # [n, vocab]
    processors = hf_processors(params, len(prompt), eos_ids)
    temperature = 1.0 if params.greedy else params.temperature
    rows = []
    for i, row in enumerate(logits):
        scores = row[None].clone()
        for processor in processors:
            scores = processor(ids[:, :len(prompt) + i], scores)
        rows.append((scores[0] / temperature).log_softmax(dim=-1))
    return torch.stack(rows)


def check_against(reference: torch.Tensor, tokens: list[int], logprobs: list[TokenLogprobs], k: int) -> None:
    """Each reported entry against the reference rows [n, vocab]: the sampled token's logprob and rank,
    the top-k logprobs, and the top-k ids (as logprobs of the reference: a near tie may swap two ids)."""
    assert len(logprobs) == len(tokens) == reference.shape[0]
    for row, token, lp in zip(reference, tokens, logprobs):
        assert lp.token_id == token and len(lp.top_ids) == len(lp.top_logprobs) == k
        assert abs(lp.logprob - row[token].item()) < ATOL
        assert int((row > row[token] + ATOL).sum()) + 1 <= lp.rank <= int((row > row[token] - ATOL).sum()) + 1
        values = row.topk(k).values  # [k]
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), values, atol=ATOL, rtol=0)
        torch.testing.assert_close(row[list(lp.top_ids)], values, atol=ATOL, rtol=0)


def run(engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Every prompt's deltas, all requests stepped together."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    deltas: dict[str, list] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return list(deltas.values())


CASES = {
    "greedy": dict(temperature=0),
    "greedy penalized": dict(temperature=0, repetition_penalty=1.5, presence_penalty=0.7, logit_bias={20: 3.0}),
    "temperature": dict(temperature=0.7, seed=3),
    "temperature cut and penalized": dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.05, seed=4,
                                          frequency_penalty=0.6, repetition_penalty=0.8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_log_softmax_of_transformers_logits(case, llm, hf_model):
    k = 5
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=k, **CASES[case])
    prompts = random_prompts([4, 33], 360, seed=7)
    eos = llm.get_tokenizer().eos_token_ids
    deltas = run(llm.engine, prompts, params)  # one batch
    for prompt, request_deltas in zip(prompts, deltas):
        tokens = [t for d in request_deltas for t in d.new_token_ids]
        if params.greedy:  # the tokens are transformers' too, and its processed scores are the reference
            expected, scores = hf_generate(hf_model, prompt, params, eos)
            assert tokens == expected
            torch.testing.assert_close(torch.stack([s.log_softmax(-1) for s in scores]),
                                       teacher_forced_logprobs(hf_model, prompt, tokens, params, eos),
                                       atol=ATOL, rtol=0)
        reference = teacher_forced_logprobs(hf_model, prompt, tokens, params, eos)
        check_against(reference, tokens, [lp for d in request_deltas for lp in d.logprobs], k)
    assert_all_blocks_free(llm)


def test_offline_shape_is_vllms(llm):
    tokenizer = llm.get_tokenizer()
    prompt = random_prompts([6], 360, seed=8)
    for k in (0, 1, 3):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=k)
        out = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 4
        for token, entry in zip(out.token_ids, out.logprobs):
            assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the top one
            assert len(entry) == max(1, k)
            assert [lp.rank for t, lp in entry.items()] == list(range(1, max(1, k) + 1))
            assert all(lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
                       for t, lp in entry.items())
            assert all(isinstance(lp, Logprob) and lp.logprob <= 0 for lp in entry.values())
    plain = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain[0].outputs[0].logprobs is None
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_logprobs_follow_the_first_token_to_a_decode_engine_and_across_a_resume(ckpt, temperature):
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.3, frequency_penalty=0.4)
    prefill, decode, colocated = make_llm(str(ckpt)), make_llm(str(ckpt)), make_llm(str(ckpt))
    prompt = random_prompts([21], 360, seed=9)[0]
    whole = [d for d in _stream(colocated.engine, "w", prompt, params)]
    whole_lps = [lp for d in whole for lp in d.logprobs]
    prefill.engine.add_request("r", prompt, params, prefill_only=True)
    [first] = prefill.engine.step()
    src = list(first.kv_block_ids)
    dst = decode.engine.reserve_blocks(len(src))
    decode.engine.kv_cache.kv[:, :, torch.tensor(dst)] = prefill.engine.kv_cache.kv[:, :, torch.tensor(src)]
    assert prefill.engine.release_prefilled("r")
    with pytest.raises(ValueError, match="logprobs"):
        decode.engine.add_prefilled_request("r", prompt, first.new_token_ids[0], params, dst)
    delta = decode.engine.add_prefilled_request("r", prompt, first.new_token_ids[0], params, dst,
                                                first_logprobs=first.logprobs[0])
    deltas = [delta] + [d for _ in range(20) if decode.engine.has_unfinished_requests() for d in decode.engine.step()]
    _assert_same(whole_lps, [lp for d in deltas for lp in d.logprobs])
    head = list(_stream(colocated.engine, "h", prompt, params, stop_after=3))
    head_tokens = [t for d in head for t in d.new_token_ids][:3]
    tail = list(_stream(colocated.engine, "t", prompt + head_tokens, params, num_resumed_tokens=3))
    _assert_same(whole_lps, [lp for d in head for lp in d.logprobs][:3] + [lp for d in tail for lp in d.logprobs])
    for engine in (prefill, decode, colocated):
        assert_all_blocks_free(engine)


def _assert_same(expected: list[TokenLogprobs], got: list[TokenLogprobs]) -> None:
    assert [lp.token_id for lp in got] == [lp.token_id for lp in expected]
    for a, b in zip(expected, got):
        assert a.top_ids == b.top_ids and a.rank == b.rank
        assert abs(a.logprob - b.logprob) < 1e-5
        assert max((abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)), default=0) < 1e-5


def _stream(engine, request_id: str, prompt, params, *, num_resumed_tokens: int = 0, stop_after: int | None = None):
    """The deltas of one request stepped alone on `engine` (aborted once stop_after tokens came)."""
    engine.add_request(request_id, prompt, params, num_resumed_tokens=num_resumed_tokens)
    count = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            yield delta
            count += len(delta.new_token_ids)
        if stop_after is not None and count >= stop_after:
            engine.abort(request_id)
            return
