"""The n samples of a request (SamplingParams.n > 1) on the coordinator, disaggregated and replicas alike.

Sample j runs as a request of its own, `<request id>/<j>` with params.for_sample(j) (n = 1, seed + j as vLLM
derives it), through the coordinator's whole path (routing, prefill, KV transfer, decode, migration); the
samples run at once and their chunks come back merged in arrival order (cluster/merged_streams.py), each
with its sample `index`. Each sample's prompt is prefilled and shipped on its own: no KV is shared between
the samples here (a colocated engine prefills once and shares it: engine/fork.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

from cluster.backend import GenerationChunk, GenerationRequest
from cluster.merged_streams import MergedStreams


async def sample_chunks(generate_one: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
                        request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
    """The chunks of every sample of `request`, tagged with their index; raises what a sample raises (before
    any chunk when a sample fails before its first one). Closing it closes every sample's stream."""
    samples = [dataclasses.replace(request, request_id=f"{request.request_id}/{j}", params=request.params.for_sample(j))
               for j in range(request.params.n)]
    merged = MergedStreams([generate_one(sample) for sample in samples])
    await merged.open()
    try:
        async for index, chunk in merged:
            yield dataclasses.replace(chunk, index=index)
    finally:
        await merged.aclose()
