"""Structured outputs served on a real local Ray: disaggregated (1 prefill + 1 decode worker, KV over gRPC on
127.0.0.1: the prefill worker samples the first token under the grammar, the decode worker continues with a
matcher of its own advanced over it) and as 2 colocated replicas. Seeded output equals the in-process engine's
token for token (a draw depends on (seed, position) alone), validates against its schema, matches its regex or
is one of its choices, with n = 2 too; afterwards every worker holds nothing."""
from __future__ import annotations

import asyncio
import json
import re
from contextlib import aclosing

import jsonschema
import pytest

from cluster.workers.cluster_config import ClusterConfig
from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from tests.support.cluster_rig import request, running_cluster, wait_until_idle
from tests.support.engine_checks import random_prompts

POOL_BYTES = 4 << 20
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 5},
    "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "minItems": 1, "maxItems": 3},
    "nested": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["n"], "additionalProperties": False}},
    "required": ["name", "sizes", "nested"], "additionalProperties": False}
REGEX = r"[a-z]{2,4}@[0-9]{2}"
SPECS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=["north", "south", "east"]), StructuredOutputsParams(json=SCHEMA)]


@pytest.fixture(scope="module")
def checkpoint(llama_checkpoint) -> str:
    return llama_checkpoint


@pytest.fixture(scope="module", params=["disaggregated", "replicas"])
def cluster(checkpoint, request):
    """disaggregated: the package's 1 prefill + 1 decode workers, KV over gRPC, POOL_BYTES each (conftest.py);
    replicas: 2 colocated replicas of this module's own."""
    if request.param == "disaggregated":
        yield request.getfixturevalue("llama_pair")
        return
    config = ClusterConfig(model=checkpoint, device="cpu", engine=EngineConfig(kv_cache_memory=POOL_BYTES),
                           expect_timeout_s=30.0, worker_start_timeout_s=60.0, num_prefill_workers=0,
                           num_decode_workers=2)
    with running_cluster(config) as coordinator:
        yield coordinator


def params(index: int, spec: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(max_tokens=100, temperature=1.0, seed=40 + index, n=2 if index == 3 else 1,
                          structured_outputs=spec)


def test_served_structured_output_equals_the_engine_and_follows_each_grammar(cluster, checkpoint):
    prompts = random_prompts([5, 18, 33, 9], 360, seed=21)

    async def scenario():
        generations = [request(f"so-{i}", p, params(i, s)) for i, (p, s) in enumerate(zip(prompts, SPECS))]
        results = await asyncio.gather(*[_samples(cluster, g) for g in generations])
        await wait_until_idle(cluster)
        return results

    served = asyncio.run(scenario())
    with LLM(checkpoint, kv_cache_memory=POOL_BYTES) as local:
        expected = local.generate(prompt_token_ids=prompts, sampling_params=[params(i, s) for i, s in enumerate(SPECS)],
                                  use_tqdm=False)
    for got, want in zip(served, expected):
        assert [got[j][0] for j in sorted(got)] == [c.token_ids for c in want.outputs]
    texts = [[want.outputs[j].text for j in range(len(want.outputs))] for want in expected]
    for text in texts[0] + texts[3]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, texts[1][0]) and texts[2][0] in ("north", "south", "east")
    assert all(got[j][1] == "stop" for got in served for j in got)


async def _samples(backend, generation) -> dict[int, tuple[list[int], str]]:
    """Each sample's tokens and finish reason."""
    samples: dict[int, tuple[list[int], str]] = {}
    async with aclosing(backend.generate(generation)) as chunks:
        async for chunk in chunks:
            tokens, _ = samples.get(chunk.index, ([], None))
            samples[chunk.index] = (tokens + list(chunk.token_ids), chunk.finish_reason)
    return samples
