"""ChoiceStreams: the backend streams of one OpenAI request, run concurrently and merged into one stream of
choices.

A completion request with a batch of prompts is one GenerationRequest per prompt; a request with n > 1 asks
its backend for n samples of its prompt, which come back as chunks with `index` 0..n-1. OpenAI numbers the
choices prompt-major: choice = prompt_index * n + sample index. Every prompt's stream runs in its own task
(the backend sees them as separate requests, at once) and their chunks are merged in arrival order
(cluster/merged_streams.py): `open()` raises an error any of them raises before its first chunk, so that it
becomes the answer's status; closing cancels the streams still running, which aborts their requests.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from cluster.backend import Backend, GenerationChunk, GenerationRequest
from cluster.merged_streams import MergedStreams


@dataclass(frozen=True)
class ChoiceChunk:
    """One backend chunk of choice `choice` (prompt `prompt`)."""

    choice: int
    prompt: int
    chunk: GenerationChunk


class ChoiceStreams:
    """`await open()`, `async for item in streams` (ChoiceChunks), `await aclose()`."""

    def __init__(self, backend: Backend, requests: Sequence[GenerationRequest], n: int) -> None:
        self._merged = MergedStreams([backend.generate(request) for request in requests])
        self._n = n

    async def open(self) -> None:
        """Start every prompt's stream; raises the first error any of them raises before its first chunk."""
        await self._merged.open()

    async def __aiter__(self) -> AsyncIterator[ChoiceChunk]:
        async for prompt, chunk in self._merged:
            yield ChoiceChunk(prompt * self._n + chunk.index, prompt, chunk)

    async def aclose(self) -> None:
        """Cancel the streams still running (their requests are aborted) and wait for them to close."""
        await self._merged.aclose()
