"""Logits processors against transformers: greedy tokens with repetition / presence / frequency penalties,
logit_bias and min_tokens equal transformers' generate() with the equivalent logits processors; min_p's
kept set equals MinPLogitsWarper's; seeded draws with penalties are the same whatever the batch; stop
strings wait for min_tokens; bad values are ValueErrors naming the field. Every test ends with every
KV block free."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampling.sampler import sampling_probs
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm
from tests.support.factories import load_hf_model
from tests.support.hf_processors import hf_generate

logits_process = pytest.importorskip("transformers.generation.logits_process")

MAX_TOKENS = 12
PROMPT_LENGTHS = [3, 17, 40]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(str(ckpt)) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return load_hf_model(ckpt)


GREEDY_CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition below 1": dict(repetition_penalty=0.6),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=-0.7),
    "all penalties": dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.9),
    "logit_bias": dict(logit_bias={5: 3.0, 77: -100.0, 300: 2.5}),
    "bias and penalties": dict(logit_bias={40: 4.0}, repetition_penalty=1.5, frequency_penalty=0.5),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_with_processors_equals_transformers(case, llm, hf_model):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **GREEDY_CASES[case])
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = random_prompts(PROMPT_LENGTHS, 360, seed=4)
    eos = llm.get_tokenizer().eos_token_ids
    # one batch: processed rows beside plain ones (which must be unaffected)
    outs = llm.generate(prompt_token_ids=prompts * 2, sampling_params=[params] * 3 + [plain] * 3, use_tqdm=False)
    for prompt, out, bare in zip(prompts, outs[:3], outs[3:]):
        expected, _ = hf_generate(hf_model, prompt, params, eos)
        assert out.outputs[0].token_ids == expected, case
        assert bare.outputs[0].token_ids == hf_generate(hf_model, prompt, plain, eos)[0]
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs[:3], outs[3:])), \
        f"{case} changed no token: the test proves nothing"
    assert_all_blocks_free(llm)


def test_min_tokens_masks_eos_and_stop_ids_then_lets_them_end_it(llm, hf_model):
    eos = llm.get_tokenizer().eos_token_ids
    prompt = random_prompts([9], 360, seed=5)[0]
    stop_id = 7
    # EOS and the stop id are pushed to the top: without min_tokens the first token would end it
    bias = {eos[0]: 30.0, stop_id: 29.0}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=4, stop_token_ids=[stop_id],
                            logit_bias=bias)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    expected, _ = hf_generate(hf_model, prompt, params, eos)
    assert out.token_ids == expected[:5] and out.finish_reason == "stop"
    assert out.token_ids[4] == eos[0] and not set(out.token_ids[:4]) & {*eos, stop_id}
    eager = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id], logit_bias=bias)
    ended = llm.generate(prompt_token_ids=[prompt], sampling_params=eager, use_tqdm=False)[0].outputs[0]
    assert len(ended.token_ids) == 1 and ended.token_ids[0] in (eos[0], stop_id) and ended.finish_reason == "stop"
    ignoring = SamplingParams(max_tokens=6, temperature=0, min_tokens=6, ignore_eos=True, logit_bias={eos[0]: 30.0})
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=ignoring,
                        use_tqdm=False)[0].outputs[0].token_ids == [eos[0]] * 6  # ignore_eos: EOS is not masked
    assert_all_blocks_free(llm)


def test_stop_strings_wait_for_min_tokens(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("The cache holds keys and values")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    full = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0].outputs[0]
    first_text = tokenizer.decode(full.token_ids[:1])
    assert first_text.strip(), f"need visible text to stop on, got {full.text!r}"
    stop = first_text.strip()[0]
    early = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop])
    stopped = llm.generate(prompt_token_ids=[prompt], sampling_params=early, use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    n0 = len(stopped.token_ids)
    for min_tokens in (n0, n0 + 2, n0 + 5):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop],
                                min_tokens=min_tokens)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) > min_tokens and out.token_ids == full.token_ids[:len(out.token_ids)]
        assert stop in out.text  # the early stop string did not end it, nor cut the text
    assert_all_blocks_free(llm)


def test_min_p_keeps_what_transformers_keeps():
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(3)) * 2  # [6, vocab]
    params = [SamplingParams(min_p=m, temperature=t) for m, t in
              [(0.05, 1.0), (0.2, 0.7), (0.5, 1.3), (1.0, 1.0), (0.01, 2.0), (0.3, 1.0)]]
    params[5] = SamplingParams(min_p=0.3, top_k=50, top_p=0.9)
    got = sampling_probs(logits, params)  # [6, vocab]
    for row, p in enumerate(params):
        scores = logits[row:row + 1] / p.temperature
        kept = logits_process.MinPLogitsWarper(p.min_p)(None, scores) > float("-inf")  # [1, vocab]
        if p.top_k > 0:
            kept &= logits_process.TopKLogitsWarper(p.top_k)(None, scores) > float("-inf")
            kept &= logits_process.TopPLogitsWarper(p.top_p)(None, scores.masked_fill(~kept, float("-inf"))) \
                > float("-inf")
        assert torch.equal(got[row] > 0, kept[0]), p
        assert 1 <= int(kept.sum()) < 3000
    assert torch.allclose(got.sum(dim=-1), torch.ones(6))


def test_seeded_draws_with_penalties_do_not_depend_on_the_batch(llm):
    prompts = random_prompts([5, 30, 12, 50], 360, seed=6)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, min_p=0.02, seed=11, ignore_eos=True,
                            repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={9: 2.0})
    alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, repetition_penalty=1.2),
              SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=-1)]
    for at in range(4):
        batch = others[:at] + [params] + others[at:]
        prompt_batch = prompts[1:at + 1] + prompts[:1] + prompts[at + 1:]
        outs = llm.generate(prompt_token_ids=prompt_batch, sampling_params=batch, use_tqdm=False)
        assert outs[at].outputs[0].token_ids == alone
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("fields, name", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logit_bias={-3: 1.0}), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"), (dict(presence_penalty=float("nan")), "presence_penalty")])
def test_bad_values_are_value_errors_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(logit_bias={vocab: 1.0}))
    assert_all_blocks_free(llm)
