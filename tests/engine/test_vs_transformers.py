"""Greedy float32 output equals transformers' generate(do_sample=False), token for token."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm
from tests.support.factories import hf_greedy_generate, load_hf_model

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 333]
MAX_TOKENS = 10


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_transformers(arch, tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint(arch)
    llm = make_llm(str(path), dtype="float32", device="cpu")
    prompts = random_prompts(PROMPT_LENGTHS, llm.get_tokenizer().vocab_size, seed=1)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_blocks_free(llm)


def test_sharded_checkpoint_and_text_prompts(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama3", shards=3)
    assert len(list(path.glob("*.safetensors"))) == 3
    llm = make_llm(str(path))
    tokenizer = llm.get_tokenizer()
    texts = ["Hello world", "The paged cache stores keys and values in blocks of tokens."]
    expected = hf_greedy(path, [tokenizer.encode(t) for t in texts], MAX_TOKENS)
    outputs = llm.generate(texts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for out, text, tokens in zip(outputs, texts, expected):
        assert out.prompt == text
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].text == tokenizer.decode(tokens)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_matches_transformers_in_same_dtype(dtype, tiny_checkpoint):
    """Half precision takes the torch attention path on CPU; it must match transformers in that dtype."""
    path = tiny_checkpoint("qwen2")
    llm = make_llm(str(path), dtype=dtype, device="cpu")
    assert llm.engine.runner.attention.name == "torch"
    prompts = random_prompts([5, 40, 130], llm.get_tokenizer().vocab_size, seed=3)
    expected = hf_greedy_generate(load_hf_model(path, getattr(torch, dtype)), prompts, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm)
