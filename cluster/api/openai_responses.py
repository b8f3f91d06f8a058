"""OpenAI-shaped response objects: text completions and chat completions, whole and streamed (SSE).

A ResponseShape knows one request's id, model and creation time and turns backend chunks into the
JSON objects OpenAI's clients expect, plus Tandem's `tandem_timing` on the last one. With logprobs asked,
each choice's `logprobs` is OpenAI's object for its tokens (openai_logprobs.py).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

from cluster.api.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs
from cluster.backend import GenerationChunk, Timing
from engine.logprobs import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timing_dict(timing: Timing | None) -> dict | None:
    return None if timing is None else dataclasses.asdict(timing)


class ResponseShape(ABC):
    """Common envelope of one request's response objects. Subclasses shape the choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, return_token_ids: bool,
                 logprobs: int | None = None, tokenizer=None) -> None:
        """logprobs: the request's SamplingParams.logprobs (None: no logprobs object); tokenizer decodes
        the tokens of the logprobs objects."""
        self.request_id, self.model, self.created = request_id, model, created
        self.return_token_ids = return_token_ids
        self._texts = TokenTexts(tokenizer) if logprobs is not None else None
        self._text_offset = 0  # completions: where the next token's text starts in the completion

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str, token_ids: list[int], finish_reason: str | None, timing: Timing | None,
             prompt_tokens: int, logprobs: list[TokenLogprobs] | None = None) -> dict:
        """The non-streaming response of the whole request (logprobs: one per token, when asked)."""
        choice = self._full_choice(text, finish_reason)
        if self._texts is not None:
            choice["logprobs"] = self._logprobs(logprobs or ())
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        response = self._envelope(self.object_name, [choice])
        response["usage"] = usage(prompt_tokens, len(token_ids))
        response["tandem_timing"] = timing_dict(timing)
        return response

    def stream_opening(self) -> list[dict]:
        """Objects sent before the first chunk's (chat announces the assistant role)."""
        return []

    def stream_chunk(self, chunk: GenerationChunk, include_usage: bool) -> dict:
        """The streamed object of one backend chunk; the last carries finish_reason and tandem_timing."""
        choice = self._delta_choice(chunk.text, chunk.finish_reason)
        if self._texts is not None:
            choice["logprobs"] = self._logprobs(chunk.logprobs or ())
        if self.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        response = self._envelope(self.chunk_object_name, [choice])
        if include_usage:
            response["usage"] = None
        if chunk.finish_reason is not None:
            response["tandem_timing"] = timing_dict(chunk.timing)
        return response

    def stream_usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The extra last object of stream_options.include_usage: no choices, the usage."""
        response = self._envelope(self.chunk_object_name, [])
        response["usage"] = usage(prompt_tokens, completion_tokens)
        return response

    @abstractmethod
    def _logprobs(self, logprobs) -> dict:
        """The choice's logprobs object of these tokens' TokenLogprobs."""

    @abstractmethod
    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        """One choice of a whole (non-streamed) response."""

    @abstractmethod
    def _delta_choice(self, text: str, finish_reason: str | None) -> dict:
        """One choice of a streamed chunk."""


class CompletionShape(ResponseShape):
    """/v1/completions: object "text_completion" whole and streamed."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None) -> dict:
        return self._full_choice(text, finish_reason)

    def _logprobs(self, logprobs) -> dict:
        shaped = completion_logprobs(logprobs, self._texts, self._text_offset)
        self._text_offset += sum(len(token) for token in shaped["tokens"])
        return shaped


class ChatShape(ResponseShape):
    """/v1/chat/completions: "chat.completion" whole, "chat.completion.chunk" deltas streamed."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _full_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, logprobs) -> dict:
        return chat_logprobs(logprobs, self._texts)

    def stream_opening(self) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._envelope(self.chunk_object_name, [choice])]
