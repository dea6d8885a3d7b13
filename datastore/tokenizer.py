"""Tokenizer loading (HF `tokenizers`), identity, chat-template rendering and batched parallel encoding.

`--tokenizer` accepts `default` ($RETROSPEC_CACHE/models/default/tokenizer.json), a tokenizer.json file, or a
model folder holding one. The identity (`xxh64:` of tokenizer.json's bytes) is what `--append` compares. The chat
template comes from the same folder (chat_template.jinja, else tokenizer_config.json's "chat_template") and is
rendered with jinja2 the way HF chat templates expect (trim_blocks, lstrip_blocks, `raise_exception`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .build import TokenizerIdentity
from .errors import DatastoreError
from .paths import default_model_dir


def resolve_tokenizer_path(spec: str) -> Path:
    """`default`, a tokenizer.json, or a folder holding one → the tokenizer.json path."""
    if spec == "default":
        path = default_model_dir() / "tokenizer.json"
        if not path.is_file():
            raise DatastoreError(
                f"default tokenizer not found at {path}; run `retrospec model prepare` first (or pass --tokenizer "
                "PATH to a tokenizer.json or model folder)"
            )
        return path
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DatastoreError(f"--tokenizer {spec}: no tokenizer.json at {path}; pass `default`, a tokenizer.json or a "
                             "model folder that holds one")
    return path


@dataclass
class LoadedTokenizer:
    """A tokenizer, its identity and (if any) its chat template."""

    path: Path
    identity: TokenizerIdentity
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None

    @classmethod
    def load(cls, spec: str) -> "LoadedTokenizer":
        from tokenizers import Tokenizer

        path = resolve_tokenizer_path(spec)
        raw = path.read_bytes()
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DatastoreError(f"{path}: not a valid tokenizer.json ({e}); pass a HF `tokenizers` file")
        name = "default" if spec == "default" else str(path)
        identity = TokenizerIdentity(id="xxh64:" + xxhash.xxh64(raw).hexdigest(), name=name,
                                     vocab_size=tok.get_vocab_size(with_added_tokens=True))
        return cls(path=path, identity=identity, tokenizer=tok, chat_template=_find_chat_template(path.parent))

    def render_chat(self, messages: list[dict[str, Any]], where: str) -> str:
        """Render chat messages ([{"role", "content"}]) with the chat template (no generation prompt)."""
        if self.chat_template is None:
            raise DatastoreError(
                f"{where}: chat `messages` need a chat template, but none is next to {self.path} (chat_template.jinja "
                "or tokenizer_config.json); use a model folder with one, or give plain text with --text-field"
            )
        return _compiled(self.chat_template).render(messages=messages, add_generation_prompt=False)

    def encode_stream(self, texts: Iterable[str], *, batch_chars: int = 1 << 22) -> Iterator[np.ndarray]:
        """Token ids (int64 arrays) of each text, encoded in batches of ~4M characters (parallel in Rust)."""
        batch: list[str] = []
        size = 0
        for text in texts:
            batch.append(text)
            size += len(text)
            if size >= batch_chars:
                yield from self._encode(batch)
                batch, size = [], 0
        if batch:
            yield from self._encode(batch)

    def _encode(self, batch: list[str]) -> Iterator[np.ndarray]:
        for enc in self.tokenizer.encode_batch(batch, add_special_tokens=False):
            yield np.asarray(enc.ids, dtype=np.int64)


def _find_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        try:
            template = json.loads(cfg.read_text()).get("chat_template")
        except (OSError, json.JSONDecodeError):
            return None
        if isinstance(template, str):
            return template
    return None


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    if source not in _TEMPLATES:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DatastoreError(f"chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
