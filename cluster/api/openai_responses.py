"""OpenAI-shaped response objects: text completions and chat completions, whole and streamed (SSE).

A ResponseShape knows one request's id, model and creation time and turns backend chunks into the
JSON objects OpenAI's clients expect, plus Tandem's `tandem_timing`. A request has one choice per prompt x n
samples (choice = prompt * n + sample, as OpenAI numbers them): whole, `choices` lists them by index;
streamed, each event carries one choice's delta, and a choice's last event its finish_reason and the
`tandem_timing` of that sample. With logprobs asked, each choice's `logprobs` is OpenAI's object for its
tokens (openai_logprobs.py). Completions with `echo`: a choice's text starts with its prompt's text (in its
first streamed chunk), and its logprobs object with the prompt tokens' (the first one's None).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from cluster.api.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, echoed_prompt_logprobs
from cluster.backend import GenerationChunk, Timing
from engine.sampling.logprobs import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timing_dict(timing: Timing | None) -> dict | None:
    return None if timing is None else dataclasses.asdict(timing)


@dataclass
class ChoiceResult:
    """One choice of a whole response, accumulated from its chunks."""

    index: int
    prompt: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    timing: Timing | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs or ())
        if chunk.finish_reason is not None:
            self.finish_reason, self.timing = chunk.finish_reason, chunk.timing


class ResponseShape(ABC):
    """Common envelope of one request's response objects. Subclasses shape the choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, return_token_ids: bool,
                 logprobs: int | None = None, tokenizer=None,
                 echo: tuple[tuple[str, tuple[int, ...]], ...] | None = None) -> None:
        """logprobs: the request's SamplingParams.logprobs (None: no logprobs object); tokenizer decodes
        the tokens of the logprobs objects; echo (completions): each prompt's (text, token ids) to echo."""
        self.request_id, self.model, self.created = request_id, model, created
        self.return_token_ids = return_token_ids
        self._texts = TokenTexts(tokenizer) if logprobs is not None else None
        self._text_offsets: dict[int, int] = {}  # completions: where a choice's next token's text starts
        self._echo, self._echoed = echo, set()

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, choices: list[ChoiceResult], prompt_tokens: int, timing: Timing | None) -> dict:
        """The non-streaming response: `choices` in index order, usage over all of them (prompt_tokens:
        the prompts' tokens, each prompt once), `timing` as tandem_timing."""
        shaped = []
        for result in sorted(choices, key=lambda c: c.index):
            text, logprobs = self._content(result.index, result.prompt, "".join(result.text), result.logprobs,
                                           result.prompt_logprobs)
            choice = self._full_choice(result.index, text, result.finish_reason)
            if logprobs is not None:
                choice["logprobs"] = logprobs
            if self.return_token_ids:
                choice["token_ids"] = list(result.token_ids)
            shaped.append(choice)
        response = self._envelope(self.object_name, shaped)
        response["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices))
        response["tandem_timing"] = timing_dict(timing)
        return response

    def stream_opening(self, num_choices: int) -> list[dict]:
        """Objects sent before the first chunk's (chat announces the assistant role of each choice)."""
        return []

    def stream_chunk(self, index: int, chunk: GenerationChunk, include_usage: bool, prompt: int = 0) -> dict:
        """The streamed object of one backend chunk of choice `index` (of prompt `prompt`); a choice's last
        carries its finish_reason and tandem_timing."""
        text, logprobs = self._content(index, prompt, chunk.text, chunk.logprobs or (), chunk.prompt_logprobs)
        choice = self._delta_choice(index, text, chunk.finish_reason)
        if logprobs is not None:
            choice["logprobs"] = logprobs
        if self.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        response = self._envelope(self.chunk_object_name, [choice])
        if include_usage:
            response["usage"] = None
        if chunk.finish_reason is not None:
            response["tandem_timing"] = timing_dict(chunk.timing)
        return response

    def stream_objects(self, index: int, chunk: GenerationChunk, include_usage: bool, prompt: int = 0) -> list[dict]:
        """The streamed objects of one backend chunk: stream_chunk's one object, unless a shape sends more."""
        return [self.stream_chunk(index, chunk, include_usage, prompt)]

    def stream_usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The extra last object of stream_options.include_usage: no choices, the usage."""
        response = self._envelope(self.chunk_object_name, [])
        response["usage"] = usage(prompt_tokens, completion_tokens)
        return response

    def _content(self, index: int, prompt: int, text: str, logprobs, prompt_logprobs) -> tuple[str, dict | None]:
        """Choice `index`'s text and logprobs object (None when not asked) of these tokens, with its prompt's
        echoed the first time the choice speaks when the request echoes."""
        shaped = self._logprobs(index, logprobs) if self._texts is not None else None
        if self._echo is None or index in self._echoed:
            return text, shaped
        self._echoed.add(index)
        prompt_text, prompt_ids = self._echo[prompt]
        if shaped is None:
            return prompt_text + text, None
        head = echoed_prompt_logprobs(prompt_ids, prompt_logprobs or (), self._texts)
        end = head["text_offset"][-1] + len(head["tokens"][-1])
        shaped["text_offset"] = [offset + end for offset in shaped["text_offset"]]
        self._text_offsets[index] = self._text_offsets.get(index, 0) + end
        return prompt_text + text, {key: head[key] + shaped[key] for key in head}

    @abstractmethod
    def _logprobs(self, index: int, logprobs) -> dict:
        """Choice `index`'s logprobs object of these tokens' TokenLogprobs."""

    @abstractmethod
    def _full_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        """One choice of a whole (non-streamed) response."""

    @abstractmethod
    def _delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        """One choice of a streamed chunk."""


class CompletionShape(ResponseShape):
    """/v1/completions: object "text_completion" whole and streamed."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _full_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return self._full_choice(index, text, finish_reason)

    def _logprobs(self, index: int, logprobs) -> dict:
        offset = self._text_offsets.get(index, 0)
        shaped = completion_logprobs(logprobs, self._texts, offset)
        self._text_offsets[index] = offset + sum(len(token) for token in shaped["tokens"])
        return shaped


class ChatShape(ResponseShape):
    """/v1/chat/completions: "chat.completion" whole, "chat.completion.chunk" deltas streamed."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _full_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def _delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, index: int, logprobs) -> dict:
        return chat_logprobs(logprobs, self._texts)

    def stream_opening(self, num_choices: int) -> list[dict]:
        return [self._envelope(self.chunk_object_name, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}])
                for index in range(num_choices)]
