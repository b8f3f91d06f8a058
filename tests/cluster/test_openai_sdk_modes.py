"""The OpenAI options through the official `openai` SDK in both serving modes, on the tiny Llama checkpoint:
colocated (a LocalEngineBackend) and disaggregated (a real local Ray: 1 prefill + 1 decode worker, KV over
gRPC, prompts under 10 tokens prefilled on the decode worker). Logprobs and top_logprobs equal log-softmax of
transformers' logits for the same tokens (within 1e-4, float32), in both; n samples of a batch of prompts with
vLLM's text options give the same choices in both (seeded samples j use seed + j wherever they run). Every
test ends with every pool empty."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from cluster.api.http_server import start_http_server
from engine import LLM, SamplingParams
from tests.support.cluster_rig import cluster_config, request, running_cluster, wait_until_idle
from tests.support.factories import load_hf_model
from tests.support.frontend_rig import local_backend
from tests.support.http_rig import KV_BYTES, openai_client

ATOL = 1e-4
LOCAL_BELOW = 10
PROMPTS = [[5, 77, 200, 31, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
CHAT = [{"role": "user", "content": "Hello there, friend. How are you today?"}]
MODES = ("colocated", "disaggregated")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(checkpoint):
    config = dataclasses.replace(cluster_config(1, 1), model=str(checkpoint), local_prefill_tokens=LOCAL_BELOW)
    with running_cluster(config) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated(checkpoint):
    return LLM(model=str(checkpoint), kv_cache_memory=KV_BYTES).engine


@contextlib.asynccontextmanager
async def served(mode: str, colocated, cluster):
    """An SDK client on an HTTP front end over the mode's backend; the backend's pools are empty after."""
    async with contextlib.AsyncExitStack() as stack:
        backend = cluster if mode == "disaggregated" else await stack.enter_async_context(
            local_backend(colocated, model_name=cluster.model_name))
        runner, port = await start_http_server(backend)
        try:
            async with openai_client(f"http://127.0.0.1:{port}") as client:
                yield client
        finally:
            await runner.cleanup()
        if mode == "disaggregated":
            await wait_until_idle(cluster)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32: log-softmax of transformers' logits before each of `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()  # [P + T, vocab]
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_and_top_logprobs_are_transformers_log_softmax(mode, checkpoint, colocated, cluster):
    model = load_hf_model(checkpoint)
    tokenizer = colocated.tokenizer
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    extra = {"ignore_eos": True, "return_token_ids": True}

    async def scenario():
        async with served(mode, colocated, cluster) as client:
            completion = await client.completions.create(model=cluster.model_name, prompt=PROMPTS, max_tokens=5,
                                                         temperature=0, logprobs=3, extra_body=extra)
            chat = await client.chat.completions.create(model=cluster.model_name, messages=CHAT, max_tokens=5,
                                                        temperature=0, logprobs=True, top_logprobs=2,
                                                        extra_body=extra)
        return completion, chat

    completion, chat = asyncio.run(scenario())
    for prompt, choice in zip(PROMPTS, completion.choices):
        tokens = choice.model_extra["token_ids"]
        expected = hf_logprobs(model, prompt, tokens)
        assert tokens == expected.argmax(dim=-1).tolist()  # greedy
        for row, token, value, top in zip(expected, tokens, choice.logprobs.token_logprobs,
                                          choice.logprobs.top_logprobs):
            assert abs(value - row[token].item()) < ATOL
            want_top = row.topk(3).values.tolist()  # tokens that decode alike share one key: compare the values
            assert max(top.values()) == pytest.approx(want_top[0], abs=ATOL)
            assert all(min(abs(value - want) for want in want_top) < ATOL for value in top.values()), (top, want_top)
    [choice] = chat.choices
    expected = hf_logprobs(model, chat_prompt, choice.model_extra["token_ids"])
    for row, token, entry in zip(expected, choice.model_extra["token_ids"], choice.logprobs.content):
        assert abs(entry.logprob - row[token].item()) < ATOL
        want_top = row.topk(2).values.tolist()
        assert len(entry.top_logprobs) == 2
        assert all(abs(t.logprob - v) < ATOL for t, v in zip(entry.top_logprobs, want_top))


def test_n_samples_of_a_batch_with_text_options_are_the_same_in_both_modes(colocated, cluster):
    """Seeded n=3 of a batch of two prompts (one prefilled on the decode worker, one on the prefill worker),
    with a stop string kept in the output and special tokens kept; streamed chat with n=2 too."""
    request = dict(model=cluster.model_name, max_tokens=8, temperature=0.9, seed=17, logprobs=1,
                   extra_body={"ignore_eos": True, "return_token_ids": True, "include_stop_str_in_output": True,
                               "skip_special_tokens": False, "stop": ["zz"]})

    async def scenario(mode: str):
        async with served(mode, colocated, cluster) as client:
            batch = await client.completions.create(prompt=PROMPTS, n=3, **request)
            stream = await client.chat.completions.create(messages=CHAT, n=2, stream=True, **{
                **request, "logprobs": True})
            events = [event.model_dump() async for event in stream]
        return batch, events

    answers = {mode: asyncio.run(scenario(mode)) for mode in MODES}
    (batch, events), (other_batch, other_events) = answers["colocated"], answers["disaggregated"]
    assert [c.index for c in batch.choices] == list(range(6))
    assert len({tuple(c.model_extra["token_ids"]) for c in batch.choices[:3]}) > 1
    for mine, theirs in zip(batch.choices, other_batch.choices):
        assert (mine.text, mine.model_extra["token_ids"]) == (theirs.text, theirs.model_extra["token_ids"])
        assert all(abs(a - b) < ATOL for a, b in zip(mine.logprobs.token_logprobs, theirs.logprobs.token_logprobs))
    assert batch.usage.model_dump() == other_batch.usage.model_dump()
    assert sorted(_chat_text(events).items()) == sorted(_chat_text(other_events).items())
    assert set(_chat_text(events)) == {0, 1}


def _chat_text(events: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


@pytest.mark.parametrize("mode", MODES)
def test_echo_returns_the_prompt_and_its_logprobs(mode, checkpoint, colocated, cluster):
    """echo: each choice starts with its prompt's text (a text prompt as sent, token ids decoded), whole and
    in the first streamed chunk of each choice. With logprobs, for each of n=2 samples of a prompt prefilled
    on the decode worker and of one prefilled on the prefill worker: the prompt tokens' logprobs (the first
    None) are transformers' log-softmax."""
    model = load_hf_model(checkpoint)
    tokenizer = colocated.tokenizer
    text = "The quick brown fox"
    request = dict(model=cluster.model_name, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})

    async def scenario():
        async with served(mode, colocated, cluster) as client:
            whole = await client.completions.create(prompt=[text, tokenizer.decode(PROMPTS[1])], echo=True, **request)
            ids = await client.completions.create(prompt=PROMPTS[1], echo=True, n=2, **request)
            stream = await client.completions.create(prompt=text, echo=True, stream=True, **request)
            first_chunk = [event async for event in stream][0]
            with_logprobs = await client.completions.create(prompt=PROMPTS, echo=True, logprobs=2, n=2, **request)
            return whole, ids, first_chunk, with_logprobs

    whole, ids, first_chunk, with_logprobs = asyncio.run(scenario())
    assert whole.choices[0].text.startswith(text) and len(whole.choices[0].text) > len(text)
    assert [c.text.startswith(tokenizer.decode(PROMPTS[1])) for c in whole.choices[1:] + ids.choices] == [True] * 3
    assert first_chunk.choices[0].text.startswith(text)
    assert len(with_logprobs.choices) == 4
    for choice in with_logprobs.choices:
        prompt = PROMPTS[choice.index // 2]
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + 4 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None and logprobs.text_offset[0] == 0
        expected = hf_logprobs(model, prompt[:1], prompt[1:])  # each prompt token given the ones before it
        for row, token, value in zip(expected, prompt[1:], logprobs.token_logprobs[1:len(prompt)]):
            assert abs(value - row[token].item()) < ATOL
        assert logprobs.tokens[:len(prompt)] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]


def test_n_samples_ship_the_prompt_once_and_fork_on_the_decode_worker(checkpoint, cluster):
    """Disaggregated n=3 of a prompt the prefill worker prefills: sample 0's KV is shipped; samples 1 and 2
    are prefilled on its decode worker, which holds the prompt's full blocks (shared with sample 0), so they
    ship nothing; the seeded samples are the colocated engine's, token for token."""
    block_size = next(w.block_size for w in cluster.workers.values() if w.role == "decode")
    prompt = [(7 * i + 3) % 250 + 2 for i in range(3 * block_size + 5)]
    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=23, ignore_eos=True)
    want = LLM(model=str(checkpoint), kv_cache_memory=KV_BYTES).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs

    async def scenario():
        tokens, timings = {}, {}
        async for chunk in cluster.generate(request("n-shared", prompt, params)):
            tokens[chunk.index] = tokens.get(chunk.index, []) + list(chunk.token_ids)
            if chunk.timing is not None:
                timings[chunk.index] = chunk.timing
        await wait_until_idle(cluster)
        return tokens, timings

    tokens, timings = asyncio.run(scenario())
    assert tokens == {j: list(want[j].token_ids) for j in range(3)}
    assert timings[0].prefill_location == "remote" and timings[0].kv_bytes > 0
    full_blocks = len(prompt) // block_size * block_size
    for j in (1, 2):
        assert (timings[j].prefill_location, timings[j].kv_bytes) == ("local", 0)
        assert timings[j].decode_cached_tokens == full_blocks
        assert timings[j].decode_worker == timings[0].decode_worker
