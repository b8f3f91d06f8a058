"""Request migration: a request whose worker died continues on the survivors where its client is.

The coordinator holds the prompt and every token it has streamed. When a worker of the request dies,
the request starts again as a *resumed* request: prompt + the tokens streamed so far, with
`num_resumed_tokens` saying how many of those were generated. A prefill worker prefills all of them (or
the decode worker, when short), the decode worker continues with the next token, and the engines replay
the streamed tokens' text, so the client gets exactly the rest of the stream: a longer gap, the same
tokens (greedy, or seeded, whose draws depend on (seed, position) alone), no error.
"""
from __future__ import annotations

import dataclasses
import time

from cluster.backend import GenerationChunk, GenerationRequest


class StreamProgress:
    """What one client has received of one request, across its attempts."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.migrations = 0

    def next_attempt(self) -> GenerationRequest:
        """The request to run now: the original, or prompt + streamed tokens once something was streamed
        (without prompt logprobs then: the first chunk delivered them)."""
        if not self.token_ids:
            return self.request
        prompt = (*self.request.prompt_token_ids, *self.token_ids)
        params = dataclasses.replace(self.request.params, prompt_logprobs=None)
        return dataclasses.replace(self.request, prompt_token_ids=prompt, params=params)

    @property
    def num_resumed_tokens(self) -> int:
        return len(self.token_ids)

    def delivered(self, chunk: GenerationChunk) -> GenerationChunk:
        """Records a chunk on its way to the client; the final chunk's TTFT is the first attempt's, and its
        timing counts the migrations."""
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids += chunk.token_ids
        if chunk.timing is None:
            return chunk
        timing = dataclasses.replace(chunk.timing, migrations=self.migrations)
        if self.first_token_at is not None:
            timing = dataclasses.replace(timing, ttft_ms=(self.first_token_at - self.request.arrival_time) * 1e3)
        return dataclasses.replace(chunk, timing=timing)


def resume_refusal(role: str, alive_prefill: int, alive_decode: int, progress: StreamProgress,
                   max_migrations: int, replicas: bool = False) -> str | None:
    """Why the request cannot continue after losing a `role` worker, or None when it can. replicas:
    the decode workers are colocated replicas (named so in the reason)."""
    if role == "decode" and alive_decode == 0:
        return f"no {'replica' if replicas else 'decode worker'} is left to continue it on"
    if role == "prefill" and alive_prefill == 0:
        return "no prefill worker is left to continue it on"
    if role == "transfer" and 0 in (alive_prefill, alive_decode):
        return "no prefill and decode worker pair is left to continue it on"
    if progress.migrations >= max_migrations:
        return f"it already moved {progress.migrations} times"
    return None
