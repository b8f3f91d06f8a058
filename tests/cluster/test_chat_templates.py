"""Chat requests rendered by the checkpoint's template as transformers renders them, through the official
`openai` SDK: assistant tool calls, tool results, a tools list and chat_template_kwargs reach a test template
that renders them all; continue_final_message leaves the last message open; what the template or vLLM refuses
is a 400. The oracle is transformers' apply_chat_template on the same checkpoint (tool-call arguments as
objects, as vLLM hands them to templates); a second engine gives the greedy tokens of that prompt."""
from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import openai
import pytest

from engine import LLM, SamplingParams
from tests.support.http_rig import KV_BYTES, MODEL, http_server, openai_client, post

TOOL_TEMPLATE = """{{ bos_token }}{% if tools %}<|tools|>
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description }} {{ tool.function.parameters | tojson }}
{% endfor %}{% endif %}{% for message in messages %}
{% if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{ raise_exception('Unknown role: ' + message.role) }}{% endif %}
<|{{ message.role }}|>{% if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}

{% if message.content %}{{ message.content }}{% endif %}{% for call in message.tool_calls or [] %}
<call>{{ call.function.name }}({{ call.function.arguments | tojson }})</call>{% endfor %}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% if think %}<think>{% endif %}{% endif %}"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ARGUMENTS = {"city": "Paris", "unit": "C"}
CONVERSATION = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
]
CONTINUED = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is"}]


def as_template_sees_it(messages: list[dict]) -> list[dict]:
    """The conversation as transformers should get it: tool-call arguments parsed into objects."""
    out = []
    for message in messages:
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = [{**call, "function": {**call["function"],
                                                           "arguments": json.loads(call["function"]["arguments"])}}
                                     for call in message["tool_calls"]]
        out.append(message)
    return out


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-template") / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(served engine, reference LLM, transformers' tokenizer) on the checkpoint with the tool template."""
    from transformers import AutoTokenizer

    return (LLM(model=str(checkpoint), kv_cache_memory=KV_BYTES).engine,
            LLM(model=str(checkpoint), kv_cache_memory=KV_BYTES), AutoTokenizer.from_pretrained(checkpoint))


def expected_ids(theirs, messages, **options) -> list[int]:
    text = theirs.apply_chat_template(as_template_sees_it(messages), tokenize=False, **options)
    return theirs(text, add_special_tokens=False)["input_ids"]


def test_tool_calls_tools_and_template_kwargs_render_as_transformers_renders_them(engines):
    served, reference, theirs = engines
    tool_ids = expected_ids(theirs, CONVERSATION, tools=TOOLS, add_generation_prompt=True, think=True)
    continued_ids = expected_ids(theirs, CONTINUED, continue_final_message=True)
    assert "<call>get_weather" in theirs.decode(tool_ids) and "[call_1]" in theirs.decode(tool_ids)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [reference.generate(prompt_token_ids=[ids], sampling_params=greedy, use_tqdm=False)[0].outputs[0]
            for ids in (tool_ids, continued_ids)]
    extra = {"ignore_eos": True, "return_token_ids": True}

    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            tool_chat = await client.chat.completions.create(
                model=MODEL, messages=CONVERSATION, tools=TOOLS, max_tokens=6, temperature=0,
                extra_body={**extra, "chat_template_kwargs": {"think": True}})
            continued = await client.chat.completions.create(
                model=MODEL, messages=CONTINUED, max_tokens=6, temperature=0,
                extra_body={**extra, "add_generation_prompt": False, "continue_final_message": True})
            async with aiohttp.ClientSession(url) as session:
                tokenized = await post(session, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS,
                                                              "chat_template_kwargs": {"think": True}})
        return tool_chat, continued, tokenized

    tool_chat, continued, tokenized = asyncio.run(scenario())
    assert tokenized == (200, {"count": len(tool_ids), "max_model_len": served.max_model_len, "tokens": tool_ids,
                               "token_strs": None})
    for answer, ids, output in zip((tool_chat, continued), (tool_ids, continued_ids), want):
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.choices[0].message.content == output.text
        assert answer.choices[0].model_extra["token_ids"] == output.token_ids


REFUSED = [  # (extra request fields, the param the 400 names)
    ({"messages": CONTINUED, "extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages"),  # the template's raise_exception
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),  # a role no template names
    ({"messages": CONVERSATION, "tools": TOOLS,  # "required" is served (structured outputs); an unknown tool is not
      "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice"),
    ({"messages": [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": CONVERSATION, "extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
]


def test_what_the_template_or_vllm_refuses_is_a_400_naming_the_field(engines):
    served = engines[0]

    async def scenario():
        errors = []
        async with http_server(served) as url, openai_client(url) as client:
            for fields, _ in REFUSED:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(model=MODEL, max_tokens=2, **fields)
                errors.append(refused.value)
            fine = await client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2)
        return errors, fine

    errors, fine = asyncio.run(scenario())
    for error, (_, param) in zip(errors, REFUSED):
        assert error.status_code == 400 and error.body["param"] == param, error.body
    assert "Unknown role: developer" in errors[1].body["message"]
    assert fine.usage.completion_tokens == 2
