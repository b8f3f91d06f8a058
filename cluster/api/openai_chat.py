"""Chat requests to prompt text: OpenAI messages and vLLM's template options, rendered by the checkpoint's chat
template (which decides what of them to render), for /v1/chat/completions and /tokenize.

Messages keep what a template can use: `role`, `content` (a string, or text parts joined; null is ""), `name`,
`tool_calls` (each function's `arguments` JSON string parsed into an object, as vLLM does, since templates
render it with `tojson`; an empty list is dropped), `tool_call_id`, `reasoning_content` / `reasoning`.
Response-side fields a client may echo back (`refusal`, `annotations`, `audio`, `function_call`) are accepted
only when null or empty. Options: `tools` (OpenAI function tools, handed to the template as sent),
`documents`, `chat_template_kwargs` (extra template variables; `add_generation_prompt` and
`continue_final_message` there override the fields, as in vLLM), `add_generation_prompt` (default true),
`continue_final_message` (default false; both true is a 400, as vLLM answers). Roles: the standard ones or
one the template names (request_validation.check_chat_roles); a template's raise_exception is a 400. At most
MAX_CHAT_MESSAGES messages, counted before any is read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from cluster.api.openai_fields import bad_request, bool_field, unsupported
from cluster.api.request_validation import check_chat_roles
from engine.text.chat_template import check_template_variables

TEMPLATE_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "documents", "chat_template_kwargs",
                             "add_generation_prompt", "continue_final_message"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                            "reasoning"})
ECHOED_RESPONSE_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call"})
ACCEPTED_TOOL_CHOICES = ("none", "auto", "required")  # required / a named function: openai_tools.py forces a call
MAX_CHAT_MESSAGES = 4096  # checked before any message is looked at: rendering is work before admission


@dataclass(frozen=True)
class ChatRendering:
    """What the chat template gets besides the messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    documents: list | None = None
    template_kwargs: dict = field(default_factory=dict)


def render_chat_prompt(body: dict, tokenizer) -> str:
    """The prompt text of a chat body (`messages` and the TEMPLATE_FIELDS); OpenAIError (400) naming the
    field for anything malformed, an unknown role, or a chat the template refuses."""
    messages = chat_messages(body.get("messages"))
    rendering = chat_rendering(body)
    try:
        check_chat_roles(messages, tokenizer)
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=rendering.add_generation_prompt,
            continue_final_message=rendering.continue_final_message, tools=rendering.tools,
            documents=rendering.documents, chat_template_kwargs=rendering.template_kwargs)
    except ValueError as error:
        raise bad_request(str(error), param=getattr(error, "field", "messages")) from error


def chat_rendering(body: dict) -> ChatRendering:
    """The template options of `body` (see the module docstring)."""
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise bad_request("chat_template_kwargs must be an object", code="invalid_type", param="chat_template_kwargs")
    given = given or {}
    options = {name: bool_field(given if name in given else body, name, default)
               for name, default in (("add_generation_prompt", True), ("continue_final_message", False))}
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          param="continue_final_message")
    try:
        variables = check_template_variables({k: v for k, v in given.items() if k not in options})
    except ValueError as error:
        raise bad_request(str(error), param="chat_template_kwargs") from error
    _check_tool_choice(body.get("tool_choice"))
    bool_field(body, "parallel_tool_calls")  # accepted, changes nothing (tool calls are not parsed out)
    return ChatRendering(options["add_generation_prompt"], options["continue_final_message"],
                         _tools(body.get("tools")), _documents(body.get("documents")), variables)


def chat_messages(messages) -> list[dict]:
    """The messages as the template sees them (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise bad_request(f"at most {MAX_CHAT_MESSAGES} messages per request, got {len(messages)}", param="messages")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}] must be an object with a string 'role'", param="messages")
        cleaned.append(_message(message, f"messages[{index}]"))
    return cleaned


def _message(message: dict, where: str) -> dict:
    kept = {"role": message["role"], "content": _content(message.get("content"), where)}
    for name, value in message.items():
        if name in ("role", "content") or value is None:
            continue
        if name in ECHOED_RESPONSE_FIELDS:
            if value not in ("", [], {}):
                raise unsupported(f"{where}.{name} is not supported by this server", param=f"{where}.{name}")
        elif name not in MESSAGE_FIELDS:
            raise bad_request(f"{where}.{name} is not a message field", code="unknown_parameter",
                              param=f"{where}.{name}")
        elif name == "tool_calls":
            calls = _tool_calls(value, f"{where}.tool_calls")
            if calls:
                kept["tool_calls"] = calls
        elif not isinstance(value, str):
            raise bad_request(f"{where}.{name} must be a string", code="invalid_type", param=f"{where}.{name}")
        else:
            kept[name] = value
    return kept


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise bad_request(f"{where}.content must be a string or a list of text parts", code="unsupported_value",
                      param=f"{where}.content")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", code="invalid_type", param=where)
    parsed = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{index}] must be an object with a function {{name, arguments}}",
                              param=f"{where}[{index}].function")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise bad_request(f"{where}[{index}].function.arguments is not valid JSON",
                                  param=f"{where}[{index}].function.arguments") from None
        elif not arguments:
            arguments = {}
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def _tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", code="invalid_type", param="tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                              param=f"tools[{index}]")
    return tools


def _documents(documents) -> list | None:
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise bad_request("documents must be a list of objects", code="invalid_type", param="documents")
    return documents


def _check_tool_choice(choice) -> None:
    """none / auto (the model decides), required, or {"type": "function", "function": {"name": ...}}."""
    if choice is None or choice in ACCEPTED_TOOL_CHOICES:
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and choice.get("type", "function") == "function" \
            and isinstance(function.get("name"), str):
        return
    raise unsupported(f"tool_choice={json.dumps(choice)} is not supported: use {', '.join(ACCEPTED_TOOL_CHOICES)} "
                      "or {\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")

