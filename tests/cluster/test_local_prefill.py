"""Conditional disaggregation on a real local Ray (1 prefill + 1 decode worker, KV over gRPC): prompts
shorter than local_prefill_tokens are prefilled on the decode worker, longer ones on the prefill worker.
Both kinds, mixed in one concurrent batch, equal a colocated engine.LLM token for token; a cancel and bad
input on the local path free everything; every test ends with every pool empty."""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

import pytest

from engine import LLM, SamplingParams
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle)
from tests.support.engine_checks import random_prompts
from tests.support.timing_checks import assert_remote_prefill_timing

VOCAB = 256
LOCAL_BELOW = 20


@pytest.fixture(scope="module")
def conditional():
    with running_cluster(dataclasses.replace(cluster_config(1, 1), local_prefill_tokens=LOCAL_BELOW)) as coordinator:
        yield coordinator


def test_short_prompts_prefill_on_the_decode_worker_and_all_equal_colocated(conditional):
    lengths = [1, 5, 19, 20, 21, 64, 3, 90, 12, 33]
    prompts = random_prompts(lengths, VOCAB, seed=11)
    params = greedy(8)
    expected = LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    async def run_all():
        results = await asyncio.gather(*(collect(conditional, request(f"c{i}", p, params))
                                         for i, p in enumerate(prompts)))
        await wait_until_idle(conditional)
        return results

    results = asyncio.run(run_all())
    for prompt, out, (tokens, last) in zip(prompts, expected, results):
        assert tokens == out.outputs[0].token_ids, f"prompt of {len(prompt)} tokens differs from colocated"
        timing = last.timing
        assert timing.decode_worker == "decode-0" and timing.ttft_ms > 0
        if len(prompt) < LOCAL_BELOW:
            assert (timing.prefill_worker, timing.transfer_ms, timing.kv_bytes) == ("", 0, 0)
        else:
            assert timing.prefill_worker == "prefill-0"
            assert_remote_prefill_timing(timing)


def test_local_path_bad_input_and_cancel_free_everything(conditional):
    async def run():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(conditional, request("bad", [1, 10_000], greedy(4)))
        long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        async with aclosing(conditional.generate(request("cut", [5, 6, 7], long_run))) as chunks:
            received = 0
            async for chunk in chunks:
                received += len(chunk.token_ids)
                if received >= 3:
                    break
        await wait_until_idle(conditional)
        return received

    assert asyncio.run(run()) >= 3
