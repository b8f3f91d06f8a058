"""Tokenizers for the engine: a Hugging Face `tokenizer.json` through the `tokenizers` library, and the
byte-level tokenizer of the embedded default model. Chat templates are rendered with sandboxed jinja2
the way transformers renders them. This module never imports transformers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from engine.detokenizer import IncrementalDetokenizer, validate_token_ids

__all__ = ["ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "Tokenizer", "compile_chat_template",
           "validate_messages", "validate_token_ids"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer(ABC):
    """What the engine needs from a tokenizer. Implementations are immutable after construction."""

    vocab_size: int  # ids in [0, vocab_size) have a token; a model's embedding may be larger
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation (tokenizer, config and generation config)

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer's own BOS (if any) is included."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids >= vocab_size are skipped (as `tokenizers` does); negative ids raise ValueError.
        Invalid UTF-8 byte sequences become U+FFFD."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat. Raises ValueError on malformed messages or when the template rejects them."""


def validate_messages(messages: list[dict]) -> list[dict]:
    """Copies of the chat messages with None-valued keys dropped (as transformers does); ValueError if malformed."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {index} must be a dict with a string 'role', got {message!r}")
        cleaned.append({key: value for key, value in message.items() if value is not None})
    return cleaned


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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _select_chat_template(value: Any) -> str | None:
    """The default template from a string, a list of {"name", "template"} dicts, or a name -> template dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {entry["name"]: entry["template"] for entry in value}
    if isinstance(value, dict):
        if "default" not in value:
            raise ValueError(f"chat_template has named templates {sorted(value)} but none named 'default'")
        return value["default"]
    raise ValueError(f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(item) for item in value]


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer directory: `tokenizer.json` decides normalization, pre-tokenization, decoding and
    (through its post-processor) whether BOS is added, exactly as transformers 5 does when tokenizer.json exists
    (`add_bos_token` in tokenizer_config.json is then ignored). Encoding and chat templates equal transformers'
    `AutoTokenizer` for `tokenizer_class: PreTrainedTokenizerFast`; decode applies no space clean-up."""

    def __init__(self, backend: _BackendTokenizer, *, special_tokens: dict[str, str],
                 eos_token_ids: Sequence[int], chat_template: str | None):
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_template_source = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos_token = special_tokens.get("bos_token")
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_ids = tuple(dict.fromkeys(int(token_id) for token_id in eos_token_ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        """Load `path/tokenizer.json` plus, when present, tokenizer_config.json (special tokens, chat template),
        chat_template.jinja (overrides the config's template), generation_config.json and config.json (EOS ids;
        ints or lists, all unioned with the tokenizer's eos_token). ValueError naming a missing
        tokenizer.json; ValueError for unreadable files."""
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {directory} (looked for {tokenizer_file})")
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust library raises a bare Exception on malformed files
            raise ValueError(f"cannot load {tokenizer_file}: {error}") from error
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        special_tokens = {key: content for key in SPECIAL_TOKEN_KEYS
                          if (content := _token_content(config.get(key))) is not None}
        template_file = directory / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _select_chat_template(config.get("chat_template"))
        eos_ids = _as_id_list(backend.token_to_id(special_tokens["eos_token"])
                              if "eos_token" in special_tokens else None)
        for config_name in ("generation_config.json", "config.json"):
            eos_ids += _as_id_list(_read_json(directory / config_name).get("eos_token_id"))
        return cls(backend, special_tokens=special_tokens, eos_token_ids=eos_ids, chat_template=chat_template)

    @property
    def chat_template(self) -> str | None:
        """The jinja source of the default chat template, or None when the checkpoint has none."""
        return self._chat_template_source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(validate_token_ids(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if self._chat_template_source is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        return compile_chat_template(self._chat_template_source)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render like transformers' `apply_chat_template(messages, tokenize=False)`: variables `messages`,
        `add_generation_prompt`, `tools`/`documents` (None) and the special token strings. A template's
        `raise_exception(...)` surfaces as ValueError."""
        cleaned = validate_messages(messages)
        try:
            return self._compiled_chat_template.render(
                messages=cleaned, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self._special_tokens,
            )
        except jinja2.exceptions.TemplateError as error:
            raise ValueError(f"chat template rejected the messages: {error}") from error


class ByteTokenizer(Tokenizer):
    """The embedded default model's tokenizer: ids 0..255 are UTF-8 bytes, then `<s>`=256 (BOS),
    `</s>`=257 (EOS), `<pad>`=258. Special-token strings inside text are encoded as plain bytes."""

    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    SPECIAL_TOKENS = MappingProxyType({BOS_ID: "<s>", EOS_ID: "</s>", PAD_ID: "<pad>"})

    def __init__(self) -> None:
        self.vocab_size = 259
        self.bos_token_id = self.BOS_ID
        self.eos_token_ids = (self.EOS_ID,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        byte_ids = list(text.encode("utf-8"))
        return [self.BOS_ID, *byte_ids] if add_special_tokens else byte_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces = bytearray()
        for token_id in validate_token_ids(ids):
            if token_id < 256:
                pieces.append(token_id)
            elif token_id in self.SPECIAL_TOKENS and not skip_special_tokens:
                pieces += self.SPECIAL_TOKENS[token_id].encode("ascii")
        return pieces.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` when `add_generation_prompt`."""
        lines = []
        for index, message in enumerate(validate_messages(messages)):
            content = message.get("content", "")
            if not isinstance(content, str):
                raise ValueError(f"message {index} content must be a string, got {type(content).__name__}")
            lines.append(f"<|{message['role']}|>\n{content}\n")
        if add_generation_prompt:
            lines.append("<|assistant|>\n")
        return "".join(lines)
