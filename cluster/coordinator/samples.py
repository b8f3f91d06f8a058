"""The n samples of a request (SamplingParams.n > 1) on the coordinator, disaggregated and replicas alike.

Sample j runs as a request of its own, `<request id>/<j>` with params.for_sample(j) (n = 1, seed + j as vLLM
derives it), through the coordinator's whole path (routing, prefill, KV transfer, decode, migration); the
samples run at once and their chunks come back merged in arrival order (cluster/merged_streams.py), each
with its sample `index`. Each sample's prompt is prefilled and shipped on its own: no KV is shared between
the samples here (a colocated engine prefills once and shares it: engine/fork.py). Prompt logprobs (echo
with logprobs) are refused: they would stay on the prefill worker, which does not send them back.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from cluster.backend import GenerationChunk, GenerationRequest, InvalidField
from cluster.merged_streams import MergedStreams


async def request_chunks(generate_one: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
                         request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
    """The chunks of every sample of `request` (generate_one runs one), tagged with their index; raises what
    a sample raises (before any chunk when a sample fails before its first one), InvalidField for prompt
    logprobs. Closing it closes every sample's stream."""
    if request.params.prompt_logprobs is not None:
        raise InvalidField("echo", "prompt logprobs (echo with logprobs) are served colocated only, not here")
    if request.params.n == 1:
        async with aclosing(generate_one(request)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    samples = [dataclasses.replace(request, request_id=f"{request.request_id}/{j}", params=request.params.for_sample(j))
               for j in range(request.params.n)]
    merged = MergedStreams([generate_one(sample) for sample in samples])
    await merged.open()
    try:
        async for index, chunk in merged:
            yield dataclasses.replace(chunk, index=index)
    finally:
        await merged.aclose()
