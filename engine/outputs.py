"""What the engine hands back: per-step deltas (for streaming) and finished results (offline API)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: a token's logprob, its rank (1 = most likely) and its text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """vLLM's shape. logprobs (when the request asked): per generated token, {token id: Logprob} of the
    sampled token and its top alternatives (the sampled one first; engine/sampling/logprobs.py says of which
    logits), so a dict has `logprobs` or `logprobs` + 1 entries."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Times are time.perf_counter() seconds."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @classmethod
    def of(cls, seq) -> "RequestMetrics":
        return cls(seq.arrival_time, seq.first_token_time, time.perf_counter(),
                   seq.num_cached_tokens, seq.num_preemptions)


@dataclass
class RequestOutput:
    """A finished request, as vLLM's LLM.generate returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's: SamplingParams.prompt_logprobs


@dataclass(frozen=True)
class StepDelta:
    """What one engine step produced for one request.

    new_token_ids/new_text: tokens and stable text since the last delta. finish_reason is set on the
    last delta. For a prefill-only request the last delta also carries kv_block_ids: the blocks that
    hold the prompt's KV, kept allocated until LLMEngine.release_prefilled(request_id). logprobs: one
    TokenLogprobs per new token when the request asked for logprobs, else None. index: which of the
    request's n samples the delta belongs to (each sample has its own last delta). prompt_logprobs: on each
    sample's first delta when the request asked for them, one per prompt token (the first None).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: str | None = None
    kv_block_ids: tuple[int, ...] | None = None
    metrics: RequestMetrics | None = None   # set on the last delta
    logprobs: tuple[TokenLogprobs, ...] | None = None
    index: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.kv_block_ids is not None


@dataclass
class OutputText:
    """Incremental text of one request, with stop-string detection.

    Text that could still turn out to be the start of a stop string is held back from deltas, so a
    streamed client never sees text that the final result cuts. With include_stop_str_in_output the stop
    string stays in the text (cut after it) and nothing is held back, as vLLM does.
    """

    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    include_stop: bool = False
    text: str = ""
    emitted: int = 0
    stopped: bool = field(default=False)

    @classmethod
    def create(cls, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
               resumed_token_ids: tuple[int, ...] | list[int] = ()):
        """The text state after the prompt, or, for a resumed request, after replaying the tokens it
        already generated one by one with their deltas taken, exactly as the engine that generated
        them did (stop strings unchecked within min_tokens): its next delta is the text that engine
        would have emitted next. params: its stop strings and the text options (skip_special_tokens,
        spaces_between_special_tokens, include_stop_str_in_output)."""
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             skip_special_tokens=params.skip_special_tokens,
                                             spaces_between_special_tokens=params.spaces_between_special_tokens)
        output = cls(detokenizer, params.stop, params.include_stop_str_in_output)
        for count, token in enumerate(resumed_token_ids, start=1):
            output.append([token], check_stop=count > params.min_tokens)
            output.take_delta(final=False)
        return output

    def append(self, token_ids: list[int], check_stop: bool = True) -> bool:
        """Add tokens; returns True if a stop string appeared (the text is then cut before it, or after it
        with include_stop). check_stop False (min_tokens not reached): no stop string can end it yet; a
        later check looks only at text from a stop string's length before its new tokens, as vLLM does."""
        old_len = len(self.text)
        self.text += self.detokenizer.step(token_ids)
        if not self.stop or not check_stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, old_len - longest + 1)
        hits = [(p, p + len(s) if self.include_stop else p) for s in self.stop
                if (p := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)[1]]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """The request ended: release text the detokenizer held back (unless a stop string cut it)."""
        if not self.stopped:
            self.text += self.detokenizer.flush()

    def take_delta(self, final: bool) -> str:
        """Text not yet emitted; while running, keeps back what a stop string could still claim."""
        end = len(self.text)
        if not final and self.stop and not self.include_stop:
            end = max(self.emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
