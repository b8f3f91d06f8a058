"""The prompts of a /v1/completions request: a string, a list of token ids, or a batch (a list of strings or a
list of token-id lists, at most MAX_BATCHED_PROMPTS), each checked as any prompt is (the tokenizer takes it,
ids in the vocabulary, within the context); 400 naming `prompt` or `prompt[i]`.
"""
from __future__ import annotations

from cluster.api.openai_fields import bad_request, is_list_of
from cluster.api.request_validation import check_prompt_token_ids

MAX_BATCHED_PROMPTS = 1024  # prompts of one /v1/completions request (each its own backend request)


def completion_prompts(prompt, served) -> tuple[tuple[tuple[int, ...], ...], tuple[str | None, ...]]:
    """The token ids of each prompt of a completion's `prompt` (served: the ServedModel), and each one's text
    (None for token ids); 400 naming `prompt` (or `prompt[i]`)."""
    if isinstance(prompt, str) or is_list_of(prompt, int) and prompt:
        batch, fields = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                   or all(is_list_of(p, int) for p in prompt)):
        batch, fields = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    elif prompt is None or prompt == []:
        raise bad_request("prompt is required: a string, a list of token ids, or a list of either", param="prompt")
    else:
        raise bad_request("prompt must be a string, a list of token ids, a list of strings or a list of token-id "
                          "lists", param="prompt")
    if len(batch) > MAX_BATCHED_PROMPTS:
        raise bad_request(f"at most {MAX_BATCHED_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
    prompts = []
    for one, name in zip(batch, fields):
        try:
            if isinstance(one, str):
                prompts.append(served.encoder.encode_prompt(one, field=name))
            else:
                prompts.append(check_prompt_token_ids(one, served.tokenizer, served.max_model_len))
        except ValueError as error:
            raise bad_request(f"{name}: {error}", param=name) from error
    return tuple(prompts), tuple(one if isinstance(one, str) else None for one in batch)
