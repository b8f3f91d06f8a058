"""The HTTP routes beside generation, in vLLM's shapes: the models, /tokenize, /detokenize and /version.

    GET  /v1/models            {"object": "list", "data": [model card per served name]}
    GET  /v1/models/{id}       one model card; 404 model_not_found for a name not served
    POST /tokenize             {"model"?, "prompt": str | "messages": [...], "add_special_tokens"?, and with
                                messages the chat template options of openai_chat.py (add_generation_prompt,
                                continue_final_message, tools, documents, chat_template_kwargs)}
                                -> {"count", "max_model_len", "tokens", "token_strs": null}
    POST /detokenize           {"model"?, "tokens": [int, ...]} -> {"prompt": str}
    GET  /version              {"version": "..."}

Text is checked as generation checks it (a lone surrogate, text the tokenizer cannot take, an unknown chat
role: 400 naming the field), but not against the context: /tokenize is how a client finds out how long a
prompt is (vLLM does the same). Ids outside the vocabulary are a 400. Inputs past OFF_LOOP_INPUT_CHARS are
tokenized on a worker thread, as generation requests are.
"""
from __future__ import annotations

import asyncio
from importlib import metadata

from aiohttp import web

from cluster.api.openai_chat import TEMPLATE_FIELDS, render_chat_prompt
from cluster.api.openai_fields import OpenAIError, bad_request, bool_field
from cluster.api.openai_protocol import ServedModel, parse_json_body, requested_model
from cluster.api.request_validation import OFF_LOOP_INPUT_CHARS, tokenize_text

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                             *TEMPLATE_FIELDS})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tandem_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class UtilityRoutes:
    """The handlers above over one served model."""

    def __init__(self, served: ServedModel) -> None:
        self._served = served

    def add_to(self, app: web.Application, expect_handler=None) -> None:
        """Adds the routes to `app`, each with `expect_handler` (None: aiohttp's)."""
        routes = app.router
        routes.add_get("/v1/models", self.models, expect_handler=expect_handler)
        routes.add_get("/v1/models/{model_id:.+}", self.model, expect_handler=expect_handler)  # names may hold "/"
        routes.add_post("/tokenize", self.tokenize, expect_handler=expect_handler)
        routes.add_post("/detokenize", self.detokenize, expect_handler=expect_handler)
        routes.add_get("/version", self.version, expect_handler=expect_handler)

    def _card(self, name: str) -> dict:
        served = self._served
        return {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "root": served.name,
                "parent": None, "max_model_len": served.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(name) for name in self._served.names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._served.names:
            raise OpenAIError(404, f"The model `{name}` does not exist", code="model_not_found", param="model")
        return web.json_response(self._card(name))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": tandem_version()})

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response(await _off_loop_if_large(await request.read(), self._tokenize))

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response(await _off_loop_if_large(await request.read(), self._detokenize))

    def _tokenize(self, raw: bytes) -> dict:
        body = _body(raw, TOKENIZE_FIELDS, self._served)
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("give exactly one of prompt (a string) or messages", param="prompt")
        if bool_field(body, "return_token_strs"):
            raise bad_request("return_token_strs is not supported by this server", code="unsupported_parameter",
                              param="return_token_strs")
        tokenizer = self._served.tokenizer
        try:
            if "prompt" in body:
                add_special = bool_field(body, "add_special_tokens", default=True)
                ids = tokenize_text(body["prompt"], tokenizer, add_special, "prompt")
            else:
                ids = self._chat_ids(body)
        except ValueError as error:
            raise bad_request(str(error), param=getattr(error, "field", None)) from error
        return {"count": len(ids), "max_model_len": self._served.max_model_len, "tokens": list(ids),
                "token_strs": None}

    def _chat_ids(self, body: dict) -> list[int]:
        """The messages rendered with the chat template as a chat request is (openai_chat.py) and encoded
        without special tokens unless add_special_tokens (the template writes them)."""
        text = render_chat_prompt(body, self._served.tokenizer)
        return tokenize_text(text, self._served.tokenizer, bool_field(body, "add_special_tokens"), "messages")

    def _detokenize(self, raw: bytes) -> dict:
        body = _body(raw, DETOKENIZE_FIELDS, self._served)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise bad_request("tokens must be a list of token ids", param="tokens")
        vocab = self._served.tokenizer.vocab_size
        for index, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise bad_request(f"tokens[{index}] = {str(token)[:32]} is not a token id of the vocabulary "
                                  f"[0, {vocab})", param=f"tokens[{index}]")
        return {"prompt": self._served.tokenizer.decode(tokens, skip_special_tokens=False)}


def _body(raw: bytes, known: frozenset, served: ServedModel) -> dict:
    """The JSON object of a utility request, every field known; `model`, if given, served."""
    body = parse_json_body(raw)
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", code="unknown_parameter",
                              param=name)
    requested_model(body, served)
    return body


async def _off_loop_if_large(raw: bytes, handle) -> dict:
    if len(raw) > OFF_LOOP_INPUT_CHARS:
        return await asyncio.to_thread(handle, raw)
    return handle(raw)
