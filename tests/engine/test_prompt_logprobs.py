"""Prompt logprobs (SamplingParams.prompt_logprobs) against log-softmax of transformers' logits: the prompt
prefilled in chunks, a prompt the prefix cache holds (a request asking for them computes it anyway), n
samples sharing one set; the first prompt token has none."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm
from tests.support.factories import load_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def test_prompt_logprobs_are_transformers_log_softmax(ckpt):
    llm = make_llm(str(ckpt), block_size=8, max_num_batched_tokens=24, max_model_len=256)  # prompts in chunks
    model = load_hf_model(ckpt)
    prompts = random_prompts([50, 9, 1], 300, seed=9)
    cached = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=cached, use_tqdm=False)  # now in the prefix cache
    params = SamplingParams(n=2, max_tokens=3, temperature=0.7, seed=3, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None and len(output.outputs) == 2
        for i, (entry, row) in enumerate(zip(entries[1:], hf_prompt_logprobs(model, prompt)), start=1):
            token = prompt[i]
            assert abs(entry[token].logprob - row[token].item()) < ATOL
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(3)
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) < ATOL
    assert_all_blocks_free(llm)
