"""transformers' logits processors equivalent to a SamplingParams: the oracle of the engine's processors
and logprobs tests (RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor, and small ones
for OpenAI's presence / frequency penalties and logit_bias)."""
from __future__ import annotations

import torch
from transformers.generation import logits_process

from engine import SamplingParams


class OpenAIPenalties(logits_process.LogitsProcessor):
    """presence / frequency penalties over the generated tokens (OpenAI's definition)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_length:]  # [1, n]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class AddBias(logits_process.LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token_id, value in self.bias.items():
            scores[:, token_id] += value
        return scores


def hf_processors(params: SamplingParams, prompt_length: int, eos_ids) -> list:
    """transformers' processors equivalent to params, in vLLM's order (min_tokens, bias, penalties)."""
    processors = []
    if params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        processors.append(logits_process.MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, banned))
    if params.logit_bias:
        processors.append(AddBias(dict(params.logit_bias)))
    if params.repetition_penalty != 1.0:
        processors.append(logits_process.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(prompt_length, params.presence_penalty, params.frequency_penalty))
    return processors


def hf_generate(model, prompt: list[int], params: SamplingParams, eos_ids) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of transformers' generate() with the processors, EOS never stopping it, and the
    processed scores of each step ([vocab] each)."""
    from transformers import GenerationConfig, LogitsProcessorList

    model.generation_config = GenerationConfig(do_sample=False)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=params.max_tokens,
                             do_sample=False, return_dict_in_generate=True, output_scores=True,
                             logits_processor=LogitsProcessorList(hf_processors(params, len(prompt), eos_ids)))
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]
