"""Tokenizers for the engine: a Hugging Face `tokenizer.json` through the `tokenizers` library, and the
byte-level tokenizer of the embedded default model. Chat templates are rendered with sandboxed jinja2
the way transformers renders them (engine/text/chat_template.py). This module never imports transformers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as _BackendTokenizer

from engine.text.chat_template import check_template_variables, compile_chat_template, named_chat_templates, render_chat

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "compile_chat_template", "validate_messages",
           "validate_token_ids"]

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
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids >= vocab_size are skipped (as `tokenizers` does); negative ids raise ValueError.
        Invalid UTF-8 byte sequences become U+FFFD. spaces_between_special_tokens False (vLLM's option): the
        added tokens kept in the text are joined to the text around them with no separator, each run of
        other tokens decoded on its own; True: the tokenizer's own decode."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, tools: list | None = None,
                            documents: list | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                            ) -> str:
        """The prompt text for a chat. continue_final_message: the final message is left open for the model to
        continue (no end of turn; excludes add_generation_prompt). tools, documents and chat_template_kwargs
        (extra template variables) are the template's to render or ignore. Raises ValueError on malformed
        messages or when the template rejects them."""


def validate_token_ids(ids: Sequence[int]) -> list[int]:
    """`ids` as a list of ints; ValueError naming the first entry that is not a non-negative int."""
    checked = list(ids)
    for position, token_id in enumerate(checked):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"token id at position {position} must be a non-negative int, got {token_id!r}")
    return checked


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
                 eos_token_ids: Sequence[int], chat_template: str | Mapping[str, str] | None):
        """chat_template: one template, or {name: template} with a "default" (and a "tool_use" one, which
        transformers picks when tools are given)."""
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_templates = named_chat_templates(chat_template)
        self._compiled: dict[str, Any] = {}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos_token = special_tokens.get("bos_token")
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_ids = tuple(dict.fromkeys(int(token_id) for token_id in eos_token_ids))

    @property
    def native(self) -> _BackendTokenizer:
        """The `tokenizers.Tokenizer` behind this one (its batch calls release the GIL); read-only use."""
        return self._backend

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
            chat_template = config.get("chat_template")
        eos_ids = _as_id_list(backend.token_to_id(special_tokens["eos_token"])
                              if "eos_token" in special_tokens else None)
        for config_name in ("generation_config.json", "config.json"):
            eos_ids += _as_id_list(_read_json(directory / config_name).get("eos_token_id"))
        return cls(backend, special_tokens=special_tokens, eos_token_ids=eos_ids, chat_template=chat_template)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json (special tokens, chat templates; the fast tokenizer class,
        so transformers keeps tokenizer.json's pipeline) and the EOS ids into generation_config.json, such that
        HFTokenizer.from_dir and transformers' AutoTokenizer load this tokenizer back. Overwrites those files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        templates = self._chat_templates
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  **self._special_tokens,
                  "chat_template": templates.get("default") if list(templates) == ["default"]
                  else [{"name": name, "template": source} for name, source in templates.items()] or None}
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False))
        generation = {"eos_token_id": list(self.eos_token_ids), "bos_token_id": self.bos_token_id}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))

    @property
    def chat_template(self) -> str | None:
        """The jinja source of the default chat template, or None when the checkpoint has none."""
        return self._chat_templates.get("default")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        ids = validate_token_ids(ids)
        if spaces_between_special_tokens or not self._added_tokens.keys() & set(ids):
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for token_id in ids:
            added = self._added_tokens.get(token_id)
            if added is None:
                run.append(token_id)
                continue
            pieces.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
            if not (skip_special_tokens and added.special):
                pieces.append(added.content)
        pieces.append(self._backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(pieces)

    @cached_property
    def _added_tokens(self) -> dict[int, Any]:
        """Added token id -> its tokenizers.AddedToken (content, special)."""
        return dict(self._backend.get_added_tokens_decoder())

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, tools: list | None = None,
                            documents: list | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                            ) -> str:
        """Render like transformers' `apply_chat_template(messages, tokenize=False, ...)`
        (engine/text/chat_template.py): the "tool_use" template when tools are given and the checkpoint has
        one, else the default; variables `messages`, `add_generation_prompt`, `tools`, `documents`, the special
        token strings and chat_template_kwargs (which may override those strings). A template's
        `raise_exception(...)` surfaces as ValueError."""
        cleaned = validate_messages(messages)
        name = "tool_use" if tools is not None and "tool_use" in self._chat_templates else "default"
        source = self._chat_templates.get(name)
        if source is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if name not in self._compiled:
            self._compiled[name] = compile_chat_template(source)
        variables = {**self._special_tokens, **check_template_variables(chat_template_kwargs)}
        return render_chat(self._compiled[name], source, cleaned, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools, documents=documents,
                           variables=variables)


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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Bytes and special tokens are joined with no separator either way."""
        pieces = bytearray()
        for token_id in validate_token_ids(ids):
            if token_id < 256:
                pieces.append(token_id)
            elif token_id in self.SPECIAL_TOKENS and not skip_special_tokens:
                pieces += self.SPECIAL_TOKENS[token_id].encode("ascii")
        return pieces.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, tools: list | None = None,
                            documents: list | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                            ) -> str:
        """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` when `add_generation_prompt`; with
        continue_final_message the final message ends right after its content. Only roles and contents are
        rendered (tool calls, tools, documents and template variables are not)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        check_template_variables(chat_template_kwargs)
        lines = []
        for index, message in enumerate(validate_messages(messages)):
            content = message.get("content", "")
            if not isinstance(content, str):
                raise ValueError(f"message {index} content must be a string, got {type(content).__name__}")
            lines.append(f"<|{message['role']}|>\n{content}\n")
        if continue_final_message:
            lines[-1] = lines[-1][:-1]
        if add_generation_prompt:
            lines.append("<|assistant|>\n")
        return "".join(lines)
