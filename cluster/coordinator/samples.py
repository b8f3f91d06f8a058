"""The n samples of a request (SamplingParams.n > 1) on the coordinator, disaggregated and replicas alike.

Sample j runs as a request of its own, `<request id>/<j>` with params.for_sample(j) (n = 1, seed + j as vLLM
derives it), through the coordinator's whole path (routing, prefill, KV transfer, decode, migration), so
each sample fails over on its own. The prompt is prefilled and shipped once: sample 0 (the leader) goes
first; once its first token is out (its KV landed on its decode worker and sits in that worker's prefix
cache), the others (followers) start, asked of the same decode worker first, which then holds every full
block of their prompt (pinned for them, shared by reference with the leader's sequence) and prefills the
rest of the last block itself: no prefill worker, no transfer. A follower the leader's worker cannot take,
or one whose prompt is no longer cached there (the leader ended at its first token, say), goes the usual
way. Their chunks come back merged in arrival order (cluster/merged_streams.py), each with its sample
`index`. Prompt logprobs are computed once, by the leader, and go out on every sample's first chunk.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from cluster.backend import GenerationChunk, GenerationRequest
from cluster.merged_streams import MergedStreams


@dataclass
class SampleGroup:
    """What the samples of one request share on the coordinator. The leader's admission records its
    decode worker; followers ask that one first and let it prefill them when it holds their prompt."""

    leader_id: str
    decode_worker: str | None = None

    def leads(self, request: GenerationRequest) -> bool:
        return request.request_id == self.leader_id


GenerateSample = Callable[[GenerationRequest, SampleGroup | None], AsyncIterator[GenerationChunk]]


async def request_chunks(generate_one: GenerateSample, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
    """The chunks of every sample of `request` (generate_one runs one), tagged with their index; raises what
    a sample raises (before any chunk when a sample fails before its first one). Closing it closes every
    sample's stream."""
    if request.params.n == 1:
        async with aclosing(generate_one(request, None)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    samples = [dataclasses.replace(request, request_id=f"{request.request_id}/{j}", params=request.params.for_sample(j))
               for j in range(request.params.n)]
    group = SampleGroup(samples[0].request_id)
    leader = generate_one(samples[0], group)
    try:
        first = await anext(leader, None)  # its KV is on its decode worker now (or it ended)
    except BaseException:
        await leader.aclose()
        raise
    prompt_logprobs = first.prompt_logprobs if first is not None else None
    followers = [_with_prompt_logprobs(generate_one(_follower(sample), group), prompt_logprobs)
                 for sample in samples[1:]]
    merged = MergedStreams([_resumed(first, leader), *followers])
    await merged.open()
    try:
        async for index, chunk in merged:
            yield dataclasses.replace(chunk, index=index)
    finally:
        await merged.aclose()


def _follower(sample: GenerationRequest) -> GenerationRequest:
    """A follower computes no prompt logprobs of its own: the leader's go out with its first chunk."""
    return dataclasses.replace(sample, params=dataclasses.replace(sample.params, prompt_logprobs=None))


async def _resumed(first: GenerationChunk | None, rest: AsyncIterator[GenerationChunk]):
    """A stream whose first chunk was already taken from it."""
    async with aclosing(rest) as chunks:
        if first is not None:
            yield first
        async for chunk in chunks:
            yield chunk


async def _with_prompt_logprobs(chunks: AsyncIterator[GenerationChunk], prompt_logprobs):
    """`chunks` with the leader's prompt logprobs on the first one."""
    async with aclosing(chunks) as stream:
        async for chunk in stream:
            if prompt_logprobs is not None:
                chunk, prompt_logprobs = dataclasses.replace(chunk, prompt_logprobs=prompt_logprobs), None
            yield chunk
