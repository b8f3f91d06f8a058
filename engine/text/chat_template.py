"""Chat templates: a checkpoint's jinja template rendered the way transformers' `apply_chat_template` renders
it (sandboxed jinja2, the same globals and filters, the same handling of tools, extra template variables and
continue_final_message). The template decides what to render: tool calls, tool results, tools, documents.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of where the final message ends
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "continue_final_message", "chat_template", "tokenize"})
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases them to each other


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a Hugging Face chat template in the environment transformers uses (sandboxed, trim/lstrip blocks,
    loop controls, `raise_exception`, `strftime_now`, non-escaping `tojson`). ValueError on a syntax error."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_template_error
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"chat template has a syntax error at line {error.lineno}: {error.message}") from error


def named_chat_templates(value: Any) -> dict[str, str]:
    """A tokenizer_config.json `chat_template` (a string, a list of {"name", "template"}, or a name -> template
    dict) as {name: template}; a single template is named "default". ValueError without a default."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        value = {entry["name"]: entry["template"] for entry in value}
    if isinstance(value, dict):
        if "default" not in value:
            raise ValueError(f"chat_template has named templates {sorted(value)} but none named 'default'")
        return dict(value)
    raise ValueError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


def check_template_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra template variables (vLLM's chat_template_kwargs) as a dict; ValueError for a name that is not a
    string or that the renderer sets itself (RESERVED_TEMPLATE_VARIABLES)."""
    variables = dict(variables or {})
    for name in variables:
        if not isinstance(name, str) or name in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(f"chat template variable {name!r} cannot be set: the names "
                             f"{', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))} are the renderer's")
    return variables


def render_chat(template: jinja2.Template, source: str, messages: Sequence[dict], *,
                add_generation_prompt: bool, continue_final_message: bool = False, tools: list | None = None,
                documents: list | None = None, variables: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `messages` (already validated copies: changed here) as transformers renders it:
    variables `messages`, `tools`, `documents`, `add_generation_prompt` and `variables` (special tokens and
    extra template variables). continue_final_message: the final message is left open (the text ends where its
    content ends: no end-of-turn, no generation prompt); it excludes add_generation_prompt. ValueError when the
    template raises (`raise_exception`) or the final message cannot be continued."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    chat = [_aliased_reasoning(message) for message in messages]
    final = _mark_final_message(chat, source) if continue_final_message else None
    try:
        rendered = template.render(messages=chat, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **dict(variables or {}))
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"chat template rejected the messages: {error}") from error
    return rendered if final is None else _cut_at_marker(rendered, final)


def _aliased_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark_final_message(chat: list[dict], source: str) -> str:
    """Appends CONTINUE_TAG to the final message's text; returns that text (before the tag)."""
    final = chat[-1].get("content")
    if final is None:
        raise ValueError("continue_final_message is set but the final message has no content to continue")
    if "content" not in source:
        raise ValueError("continue_final_message is set but the chat template does not render message content")
    if isinstance(final, str):
        chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
        return final
    parts = [dict(part) for part in final]
    for part in reversed(parts):
        if isinstance(part.get("text"), str):
            text, part["text"] = part["text"], part["text"] + CONTINUE_TAG
            chat[-1] = {**chat[-1], "content": parts}
            return text
    raise ValueError("continue_final_message is set but the final message has no text to continue")


def _cut_at_marker(rendered: str, final: str) -> str:
    marker = CONTINUE_TAG.strip()
    if final.strip() not in rendered or marker not in rendered:
        raise ValueError("continue_final_message is set but the chat template does not render the final "
                         "message's text as it is")
    at = rendered.rindex(marker)
    return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()
