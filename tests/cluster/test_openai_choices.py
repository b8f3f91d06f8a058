"""Several choices in one OpenAI answer, through the official `openai` SDK against a LocalEngineBackend on the
tiny Llama checkpoint: a batch of prompts on /v1/completions (strings, token-id lists) answered with one choice
per prompt, numbered as OpenAI numbers them, whole and streamed, each equal to the offline engine's answer
for that prompt alone, usage summed; every prompt is its own backend request, all in flight at once."""
from __future__ import annotations

import asyncio
from collections import defaultdict

import openai
import pytest

from engine import LLM, SamplingParams
from tests.support.http_rig import KV_BYTES, MODEL, http_server, openai_client

PROMPTS = ["The quick brown fox", "Hello there, friend. How are you", "It was"]
TOKEN_PROMPTS = [[5, 77, 200, 31, 9, 150], [40, 41, 42], list(range(60, 100))]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def served(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES)


def offline(reference, prompt, params: SamplingParams):
    """The offline engine's CompletionOutputs for `prompt` alone (text or token ids)."""
    if isinstance(prompt, str):
        return reference.generate([prompt], params, use_tqdm=False)[0].outputs
    return reference.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs


def test_a_batch_of_prompts_gets_one_choice_per_prompt_whole_and_streamed(served, reference):
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)
    want = [offline(reference, p, params)[0] for p in PROMPTS + TOKEN_PROMPTS]
    prompt_tokens = [len(reference.get_tokenizer().encode(p)) for p in PROMPTS] + [len(p) for p in TOKEN_PROMPTS]
    request = dict(model=MODEL, max_tokens=7, temperature=0, logprobs=2, extra_body={"ignore_eos": True})

    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            texts = await client.completions.create(prompt=PROMPTS, **request)
            ids = await client.completions.create(prompt=TOKEN_PROMPTS, **request)
            one = await client.completions.create(prompt=TOKEN_PROMPTS[0], **request)
            stream = await client.completions.create(prompt=PROMPTS, stream=True,
                                                     stream_options={"include_usage": True}, **request)
            events = [event async for event in stream]
        return texts, ids, one, events

    texts, ids, one, events = asyncio.run(scenario())
    for answer, expected, counts in ((texts, want[:3], prompt_tokens[:3]), (ids, want[3:], prompt_tokens[3:])):
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert [c.text for c in answer.choices] == [w.text for w in expected]
        assert [c.logprobs.tokens for c in answer.choices] == [[lp[t].decoded_token for lp, t in
                                                                zip(w.logprobs, w.token_ids)] for w in expected]
        assert all(c.logprobs.text_offset[0] == 0 for c in answer.choices)  # offsets run per choice
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (sum(counts), 21)
    assert [c.text for c in one.choices] == [want[3].text]
    streamed, finished = defaultdict(str), {}
    for event in events[:-1]:
        [choice] = event.choices
        streamed[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert dict(streamed) == {i: w.text for i, w in enumerate(want[:3])}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert events[-1].choices == [] and events[-1].usage.total_tokens == sum(prompt_tokens[:3]) + 21


def test_each_prompt_is_a_request_of_its_own_all_in_flight_at_once(served):
    """Behind an admission bound of 3, three prompts are served and four are a 429 (they would all be in the
    system at once); a bad prompt in a batch is a 400 naming it."""
    async def scenario():
        async with http_server(served, max_pending_requests=3) as url, openai_client(url) as client:
            three = await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=MODEL, prompt=PROMPTS + ["x"], max_tokens=2)
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model=MODEL, prompt=[[1, 2], [3, 100000]], max_tokens=2)
        return three, bad.value

    three, bad = asyncio.run(scenario())
    assert len(three.choices) == 3 and three.usage.completion_tokens == 6
    assert bad.status_code == 400 and bad.body["param"] == "prompt[1]"


def test_n_samples_of_each_prompt_are_choices_prompt_major(served, reference):
    """n=3 seeded samples of a batch of two prompts: choice i * 3 + j is sample j of prompt i, the offline
    engine's (seed + j); the prompts' tokens are counted once each. Chat, streamed: each choice is announced,
    and its deltas make its whole answer."""
    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    want = [offline(reference, p, params) for p in TOKEN_PROMPTS[:2]]
    chat = [{"role": "user", "content": "Hello there, friend"}]
    request = dict(model=MODEL, n=3, max_tokens=6, temperature=0.9, seed=5, extra_body={"ignore_eos": True})

    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            batch = await client.completions.create(prompt=TOKEN_PROMPTS[:2], **request)
            whole = await client.chat.completions.create(messages=chat, **request)
            stream = await client.chat.completions.create(messages=chat, stream=True, **request)
            events = [event async for event in stream]
        return batch, whole, events

    batch, whole, events = asyncio.run(scenario())
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [sample.text for outputs in want for sample in outputs]
    assert batch.usage.prompt_tokens == len(TOKEN_PROMPTS[0]) + len(TOKEN_PROMPTS[1])
    assert batch.usage.completion_tokens == 36
    assert len({c.text for c in batch.choices[:3]}) > 1  # samples differ
    announced = [e.choices[0].index for e in events if e.choices[0].delta.role == "assistant"]
    streamed = defaultdict(str)
    for event in events:
        streamed[event.choices[0].index] += event.choices[0].delta.content or ""
    assert announced == [0, 1, 2]
    assert dict(streamed) == {c.index: c.message.content for c in whole.choices}
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3 and whole.usage.completion_tokens == 18
