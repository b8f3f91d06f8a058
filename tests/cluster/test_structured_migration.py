"""A structured request migrates with its grammar: 1 prefill + 2 decode workers of the embedded model on a real
local Ray; decode-1 is SIGKILLed while four constrained requests decode, the ones it held resume on decode-0 as
prompt + streamed tokens, whose fresh matcher is advanced over those tokens. Every client gets what the
in-process engine gives (seeded: the same tokens), output that validates against its schema."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from contextlib import aclosing

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.support.cluster_rig import SMALL_ENGINE, cluster_config, request, running_cluster, wait_until_idle
from tests.support.engine_checks import random_prompts

SCHEMA = {"type": "object", "properties": {
    "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 90, "maxItems": 90},
    "done": {"type": "boolean"}},
    "required": ["digits", "done"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(cluster_config(1, 2)) as coordinator:
        yield coordinator


def test_a_migrated_structured_request_continues_its_grammar(cluster):
    prompts = random_prompts([12, 13, 14, 15], 256, seed=5)
    params = [SamplingParams(max_tokens=400, temperature=t, seed=3 + i,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for i, t in enumerate((0, 0.9, 0, 0.9))]
    with LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory) as local:
        expected = [o.outputs[0] for o in local.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]
    victim = cluster.workers["decode-1"]

    async def run():
        started: asyncio.Queue = asyncio.Queue()

        async def one(i: int):
            tokens, text, last = [], [], None
            async with aclosing(cluster.generate(request(f"s{i}", prompts[i], params[i]))) as chunks:
                async for chunk in chunks:
                    if not tokens:
                        started.put_nowait(i)
                    tokens += chunk.token_ids
                    text.append(chunk.text)
                    last = chunk
            return tokens, "".join(text), last

        runs = [asyncio.ensure_future(one(i)) for i in range(4)]
        for _ in runs:
            await asyncio.wait_for(started.get(), 30)
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.gather(*runs)
        await wait_until_idle(cluster)
        return results

    results = asyncio.run(run())
    assert sum(last.timing.migrations for _, _, last in results) >= 1
    for (tokens, text, last), want in zip(results, expected):
        assert tokens == want.token_ids and text == want.text and last.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
