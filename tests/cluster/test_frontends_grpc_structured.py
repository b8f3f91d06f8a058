"""Structured outputs through the public gRPC front end (GenerateRequest.structured_outputs): a real grpc.aio
server over a LocalEngineBackend on the embedded untrained model, whose output must still validate, match or be
one of the choices; a spec that does not compile is INVALID_ARGUMENT naming it, and nothing stays allocated."""
from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from engine import LLM
from proto import tandem_pb2
from tests.support.frontend_rig import assert_pool_free, grpc_stub

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    return LLM("tiny", kv_cache_memory=8 << 20).engine


def request(seed: int, **structured) -> tandem_pb2.GenerateRequest:
    return tandem_pb2.GenerateRequest(prompt="Answer:", max_tokens=60, temperature=1.0, seed=seed, n=2,
                                      structured_outputs=tandem_pb2.StructuredOutputs(**structured))


def test_every_kind_of_structured_output_over_grpc(served):
    kinds = [dict(json_schema=json.dumps(SCHEMA)), dict(regex=r"[a-z]{3}[0-9]{2}"),
             dict(choice=tandem_pb2.Choices(choices=["left", "right"])), dict(grammar='start: "a"+ "!"'),
             dict(json_object=True)]

    async def scenario():
        async with grpc_stub(served) as stub:
            return [[r async for r in stub.Generate(request(seed, **kind))] for seed, kind in enumerate(kinds)]

    answers = asyncio.run(scenario())
    texts = [["".join(r.text for r in responses if r.index == j) for j in (0, 1)] for responses in answers]
    for sample in texts[0]:
        jsonschema.validate(json.loads(sample), SCHEMA)
    assert all(re.fullmatch(r"[a-z]{3}[0-9]{2}", t) for t in texts[1])
    assert all(t in ("left", "right") for t in texts[2])
    assert all(re.fullmatch(r"a+!", t) for t in texts[3])
    assert all(t.startswith("{") for t in texts[4])
    assert_pool_free(served)


@pytest.mark.parametrize("structured, words", [
    (dict(json_schema='{"type": "strin"}'), "structured_outputs.json_schema"),
    (dict(json_schema="{oops"), "not valid JSON"),
    (dict(regex="(("), "structured_outputs.regex"),
    (dict(choice=tandem_pb2.Choices()), "empty"),
    (dict(grammar="start: missing"), "structured_outputs.grammar"),
    (dict(), "gives no kind"),
])
def test_bad_specs_are_invalid_argument(served, structured, words):
    async def scenario():
        async with grpc_stub(served) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                _ = [r async for r in stub.Generate(request(0, **structured))]
            return error.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details(), error.details()
    assert_pool_free(served)
