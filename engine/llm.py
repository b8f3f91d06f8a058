"""LLM: the offline API, mirroring vLLM's `LLM(...).generate(...)`."""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq
from dataclasses import fields

from tqdm import tqdm

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StepDelta
from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams

_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    """An engine in this process. model=None uses the embedded (untrained) default model.

    Engine options (block_size, max_num_batched_tokens, max_num_seqs, kv_cache_memory, ...) are the
    fields of engine.EngineConfig and may be given as keyword arguments.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 tokenizer: str | None = None, **engine_options) -> None:
        """model: a Hugging Face checkpoint directory, a GGUF file, or None / "tiny" (the embedded model).
        tokenizer: a Hugging Face tokenizer directory used instead of the model's own."""
        unknown = set(engine_options) - _ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.engine = build_engine(model, EngineConfig(**engine_options), dtype=dtype, device=device,
                                   tokenizer=tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Free the engine's device memory (LLMEngine.close: the KV pool, the model, the decode graphs) so that
        another engine in this process can have it. Idempotent; generate and chat raise EngineClosed after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, prompts: str | Seq[str] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: Seq[Seq[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in input order.

        Give prompts (text) or prompt_token_ids. Bad input raises ValueError before anything runs.
        """
        texts, token_lists = self._prompts(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        ids = [str(next(self._request_counter)) for _ in token_lists]
        added = []
        try:
            for request_id, tokens, p in zip(ids, token_lists, params):
                self.engine.add_request(request_id, tokens, p)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        results = self._run(ids, use_tqdm)
        return [self._output(r, t, toks, results[r], self.engine.tokenizer)
                for r, t, toks in zip(ids, texts, token_lists)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template (vLLM's options: the assistant header
        unless add_generation_prompt is false; continue_final_message leaves the last message open; tools
        and chat_template_kwargs go to the template), then generate for all of them in one batch."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt, continue_final_message=continue_final_message,
                                               tools=tools, chat_template_kwargs=chat_template_kwargs)
                 for c in conversations]
        # The template writes any BOS itself, so the text is encoded without adding special tokens.
        token_lists = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompt_token_ids=token_lists, sampling_params=sampling_params,
                                use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, list[StepDelta]]:
        deltas: dict[str, list[StepDelta]] = {r: [] for r in ids}
        bar = tqdm(total=len(ids), desc="generate", unit="req",
                   disable=not use_tqdm or not sys.stderr.isatty())
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    deltas[delta.request_id].append(delta)
                    if delta.finished and self.engine.get_sequence(delta.request_id) is None:
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return deltas

    def _prompts(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            token_lists = [list(p) for p in prompt_token_ids]
            return [None] * len(token_lists), token_lists
        if isinstance(prompts, str):
            prompts = [prompts]
        for p in prompts:
            if not isinstance(p, str):
                raise ValueError(f"prompts must be strings, got {type(p).__name__}")
        tokenizer = self.engine.tokenizer
        return list(prompts), [tokenizer.encode(p) for p in prompts]

    @staticmethod
    def _params(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return params

    @staticmethod
    def _output(request_id: str, prompt: str | None, prompt_ids: list[int],
                deltas: list[StepDelta], tokenizer) -> RequestOutput:
        """One CompletionOutput per sample (SamplingParams.n), by index; the metrics of the last to end."""
        completions = [_completion(index, [d for d in deltas if d.index == index], tokenizer)
                       for index in sorted({d.index for d in deltas})]
        metrics = deltas[-1].metrics or RequestMetrics(0.0, None, 0.0)
        given = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        prompt_logprobs = None if given is None else [lp and _logprob_dict(lp, tokenizer) for lp in given]
        return RequestOutput(request_id, prompt, prompt_ids, completions, metrics, prompt_logprobs=prompt_logprobs)


def _completion(index: int, deltas: list[StepDelta], tokenizer) -> CompletionOutput:
    token_ids = [t for d in deltas for t in d.new_token_ids]
    logprobs = None
    if deltas[0].logprobs is not None:
        logprobs = [_logprob_dict(lp, tokenizer) for d in deltas for lp in d.logprobs]
    return CompletionOutput(index, "".join(d.new_text for d in deltas), token_ids, deltas[-1].finish_reason,
                            logprobs)


def _logprob_dict(lp: TokenLogprobs, tokenizer) -> dict[int, Logprob]:
    """vLLM's per-token entry: the sampled token first, then the top alternatives, each decoded alone."""
    def decoded(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decoded(lp.token_id))}
    for rank, (token_id, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
        entry.setdefault(token_id, Logprob(value, rank, decoded(token_id)))
    return entry
