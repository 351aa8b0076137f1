"""Text <-> token ids and the chat template of a checkpoint directory or GGUF file, without torch.

From a directory: `tokenizer.json` with the `tokenizers` library and the chat template and
special tokens from `tokenizer_config.json` (falling back to `chat_template.jinja` and
`special_tokens_map.json`, where newer and older checkpoints keep them). From a GGUF file: the
same three rebuilt from its metadata (shards.gguf.vocab). The template is
rendered the way transformers renders it: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now` and a non-escaping `tojson`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from shards.errors import ModelError, NoTokenizer
from shards.gguf.file import is_gguf
from shards.gguf.vocab import read_tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class Tokenizer:
    backend: BackendTokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # "bos_token" -> "<s>", ... (only those the checkpoint sets)

    @classmethod
    def from_model(cls, model_path: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory or a GGUF file; `NoTokenizer` (a
        ModelError) where it has none that can be used."""
        return cls.from_gguf(model_path) if is_gguf(model_path) else cls.from_dir(model_path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls(*read_tokenizer(path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise NoTokenizer(
                f"no tokenizer: {model_dir} has no tokenizer.json (give the prompt as token ids)"
            )
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exception subclasses
            raise ModelError(f"unreadable tokenizer.json in {model_dir}: {exc}") from None
        settings = _read_optional_json(model_dir / "special_tokens_map.json")
        settings.update(_read_optional_json(model_dir / "tokenizer_config.json"))
        template = settings.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        return cls(backend, _named_template(template), _special_tokens(settings))

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the tokenizer's post-processor
        (e.g. a leading BOS), as transformers does by default."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered as prompt text, exactly as the checkpoint's template says."""
        if self.chat_template is None:
            raise ModelError("this model has no chat template")
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ModelError(f"chat template failed: {exc}") from None

    def prompt_ids(self, text: str) -> list[int]:
        """Ids for a single user prompt (see `conversation_ids`)."""
        return self.conversation_ids([{"role": "user", "content": text}])

    def conversation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids for a conversation: through the chat template when there is one (the rendered
        text already holds its special tokens), else the messages' contents, one per line,
        through plain `encode`."""
        if self.chat_template is None:
            return self.encode("\n".join(str(m.get("content", "")) for m in messages))
        rendered = self.apply_chat_template(messages)
        return self.encode(rendered, add_special_tokens=False)


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"unreadable {path.name} in {path.parent}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _named_template(template: Any) -> str | None:
    """Some checkpoints keep a list of named templates; the one named "default" is used."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def _special_tokens(settings: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_NAMES:
        value = settings.get(name)
        if isinstance(value, dict):  # serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering a prompt it is transparent."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ModelError(f"bad chat template: {exc}") from None
