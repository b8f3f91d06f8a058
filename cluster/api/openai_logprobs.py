"""OpenAI's logprobs objects from the engine's TokenLogprobs (engine/sampling/logprobs.py: log_softmax of the
processed logits after temperature, before the top-k / top-p / min-p cuts).

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}: each token decoded alone,
its logprob, {decoded token: logprob} of the sampled token and the `logprobs` most likely ones (so up to
logprobs + 1 entries, as OpenAI and vLLM), and each token's character offset in the completion (the sum
of the earlier tokens' decoded lengths, across the chunks of a stream). Chat: {"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]} with `top_logprobs` entries, most
likely first; bytes are the UTF-8 of the decoded token (a token that is part of a character decodes to
U+FFFD, as in vLLM). A logprob of -inf (or NaN) is reported as -9999.0, vLLM's floor, so the JSON stays valid.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.sampling.logprobs import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def reported(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False: the floor too


class TokenTexts:
    """Each token id decoded alone (special tokens included), cached for one request."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(logprobs: Sequence[TokenLogprobs], texts: TokenTexts, text_offset: int = 0) -> dict:
    """The completions object of these tokens; the first token's offset is text_offset."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for lp in logprobs:
        token = texts(lp.token_id)
        top = {token: reported(lp.logprob)}
        for token_id, value in zip(lp.top_ids, lp.top_logprobs):
            top.setdefault(texts(token_id), reported(value))
        tokens.append(token)
        token_logprobs.append(reported(lp.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprobs], texts: TokenTexts) -> dict:
    """The chat object of these tokens."""
    return {"content": [dict(_chat_entry(lp.token_id, lp.logprob, texts),
                             top_logprobs=[_chat_entry(t, v, texts) for t, v in zip(lp.top_ids, lp.top_logprobs)])
                        for lp in logprobs]}


def _chat_entry(token_id: int, value: float, texts: TokenTexts) -> dict:
    token = texts(token_id)
    return {"token": token, "logprob": reported(value), "bytes": list(token.encode("utf-8"))}


def echoed_prompt_logprobs(prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobs | None],
                           texts: TokenTexts) -> dict:
    """The completions object of an echoed prompt (`echo` with `logprobs`): each prompt token decoded alone
    and, from the second on, its logprob and top alternatives given the tokens before it (the engine's
    prompt_logprobs); the first token's are None, as OpenAI reports them. Offsets start at 0."""
    first = texts(prompt_ids[0])
    rest = completion_logprobs([lp for lp in prompt_logprobs[1:] if lp is not None], texts, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}
