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
prompt is (vLLM does the same). Ids outside the vocabulary are a 400. A large body is parsed, tokenized or
decoded, and its answer written as JSON, on the InputPool's threads, as generation requests are; the long
parts (parsing long id lists, json_runs.py; tokenizing; decoding; the token list written in slices) leave the GIL
to the event loop, and a text over IN_PROCESS_CHARS is tokenized and its ids written in a child process
(tokenize_process.py), since building and freeing the list of its millions of ids would hold the GIL for 80 ms.
"""
from __future__ import annotations

import json
import time
from importlib import metadata

from aiohttp import web

from cluster.api.openai_chat import TEMPLATE_FIELDS, render_chat_prompt
from cluster.api.openai_fields import OpenAIError, bad_request, bool_field
from cluster.api.input_pool import InputPool
from cluster.api.openai_protocol import ServedModel, parse_json_body, requested_model
from cluster.api.request_validation import InvalidField, check_text
from cluster.api.token_bounds import native_tokenizer
from cluster.api.tokenize_process import TokenizerProcess

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                             *TEMPLATE_FIELDS})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
JSON_SLICE = 8192  # token ids written per call (~1 ms): between calls the event loop can take the GIL
IN_PROCESS_CHARS = 256 * 1024  # /tokenize texts longer than this are tokenized in the TokenizerProcess


def tandem_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class UtilityRoutes:
    """The handlers above over one served model; large bodies are prepared on `inputs`."""

    def __init__(self, served: ServedModel, inputs: InputPool) -> None:
        """Reads the tokenizer (its JSON for the TokenizerProcess, which starts at the first large text) and the
        package's version once."""
        self._served, self._inputs = served, inputs
        self._version = {"version": tandem_version()}  # read once: a metadata lookup scans sys.path (~1 ms)
        native = native_tokenizer(served.tokenizer)
        self._process = None if native is None else TokenizerProcess(native.to_str())

    def add_to(self, app: web.Application, expect_handler=None) -> None:
        """Adds the routes to `app`, each with `expect_handler` (None: aiohttp's)."""
        routes = app.router
        routes.add_get("/v1/models", self.models, expect_handler=expect_handler)
        routes.add_get("/v1/models/{model_id:.+}", self.model, expect_handler=expect_handler)  # names may hold "/"
        routes.add_post("/tokenize", self.tokenize, expect_handler=expect_handler)
        routes.add_post("/detokenize", self.detokenize, expect_handler=expect_handler)
        routes.add_get("/version", self.version, expect_handler=expect_handler)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self._process is not None:
            self._process.close()

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
        return web.json_response(self._version)

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        return _json_answer(await self._inputs.prepare(len(raw), lambda: self._tokenize(raw)))

    async def detokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        return _json_answer(await self._inputs.prepare(len(raw), lambda: self._detokenize(raw)))

    def _tokenize(self, raw: bytes) -> bytes:
        body = _body(raw, TOKENIZE_FIELDS, self._served)
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("give exactly one of prompt (a string) or messages", param="prompt")
        if bool_field(body, "return_token_strs"):
            raise bad_request("return_token_strs is not supported by this server", code="unsupported_parameter",
                              param="return_token_strs")
        try:
            if "prompt" in body:
                add_special = bool_field(body, "add_special_tokens", default=True)
                count, tokens = self._token_list(body["prompt"], add_special, "prompt")
            else:
                count, tokens = self._chat_tokens(body)
        except ValueError as error:
            raise bad_request(str(error), param=getattr(error, "field", None)) from error
        return b"".join((f'{{"count": {count}, "max_model_len": {self._served.max_model_len}, "tokens": '.encode(),
                         tokens, b', "token_strs": null}'))

    def _chat_tokens(self, body: dict) -> tuple[int, bytes]:
        """The messages rendered with the chat template as a chat request is (openai_chat.py) and encoded
        without special tokens unless add_special_tokens (the template writes them)."""
        text = render_chat_prompt(body, self._served.tokenizer)
        return self._token_list(text, bool_field(body, "add_special_tokens"), "messages")

    def _token_list(self, text, add_special_tokens: bool, field: str) -> tuple[int, bytes]:
        """(count, JSON list) of the token ids of `text` (PromptEncoder.tokenize's); a text over
        IN_PROCESS_CHARS is tokenized by the TokenizerProcess where the tokenizer has one."""
        if self._process is None or not isinstance(text, str) or len(text) <= IN_PROCESS_CHARS:
            ids = self._served.encoder.tokenize(text, add_special_tokens, field)
            return len(ids), _ids_json(ids).encode()
        check_text(text, field)
        try:
            return self._process.ids_json(text, add_special_tokens)
        except ValueError as error:
            raise InvalidField(field, f"the tokenizer cannot take {field} ({error})") from None

    def _detokenize(self, raw: bytes) -> bytes:
        body = _body(raw, DETOKENIZE_FIELDS, self._served)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise bad_request("tokens must be a list of token ids", param="tokens")
        vocab = self._served.tokenizer.vocab_size
        for index, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise bad_request(f"tokens[{index}] = {str(token)[:32]} is not a token id of the vocabulary "
                                  f"[0, {vocab})", param=f"tokens[{index}]")
        return json.dumps({"prompt": self._served.encoder.decode(tokens, skip_special_tokens=False)}).encode()


def _body(raw: bytes, known: frozenset, served: ServedModel) -> dict:
    """The JSON object of a utility request, every field known; `model`, if given, served."""
    body = parse_json_body(raw)
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", code="unknown_parameter",
                              param=name)
    requested_model(body, served)
    return body


def _ids_json(ids: list[int]) -> str:
    """The JSON list of `ids`, written JSON_SLICE ids per call with the GIL offered to the event loop between
    calls: json.dumps of 2.6 million ids holds it for a third of a second in one call, and without the offer
    the loop waits a switch interval (5 ms) each time it wants it back."""
    parts = []
    for start in range(0, len(ids), JSON_SLICE):
        parts.append(json.dumps(ids[start:start + JSON_SLICE], separators=(",", ":"))[1:-1])
        time.sleep(0)  # releases the GIL: a waiting thread takes it now
    return "[" + ",".join(parts) + "]"


def _json_answer(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
