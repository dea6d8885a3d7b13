"""The corpora of the `default` preset: chitchat-dataset conversations and the CPython standard library source.

Held-out split (fixed, documented): a chitchat conversation is **held out** iff
`xxhash.xxh64_intdigest(conversation_id.encode("utf-8")) % 10 == 0` (about 10%); the rest is **train**. Only the
train part ever enters a datastore; the held-out part is for evaluation (the trajectory recorder).

A conversation in the package's dataset.json is {"messages": [[utterance, ...], ...]}: each inner list is one turn
(consecutive utterances of one speaker). It becomes chat messages with roles alternating user / assistant, the
utterances of a turn joined by "\n". Example: [[{"text": "Hi"}, {"text": "How are you?"}], [{"text": "Fine"}]] →
[{"role": "user", "content": "Hi\nHow are you?"}, {"role": "assistant", "content": "Fine"}].

Standard library: every `**/*.py` under `sysconfig.get_paths()["stdlib"]`, excluding anything under a
`site-packages` or `dist-packages` folder (third-party code stays out: evaluations use numpy/pip functions as
held-out prompts). Each file is one document.
"""

from __future__ import annotations

import json
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Literal

import xxhash

HELDOUT_MODULUS = 10


def is_heldout(conversation_id: str) -> bool:
    """The split rule: held out iff xxh64(conversation_id) % 10 == 0."""
    return xxhash.xxh64_intdigest(conversation_id.encode("utf-8")) % HELDOUT_MODULUS == 0


@lru_cache(maxsize=1)
def _chitchat_raw() -> dict:
    import chitchat_dataset

    path = Path(chitchat_dataset.__file__).parent / "dataset.json"
    return json.loads(path.read_text())


def chitchat_path() -> Path:
    import chitchat_dataset

    return Path(chitchat_dataset.__file__).parent / "dataset.json"


def conversation_messages(conversation: dict) -> list[dict[str, str]]:
    """One dataset.json conversation → chat messages alternating user/assistant (see the module docstring)."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "\n".join(u["text"] for u in turn)}
        for i, turn in enumerate(conversation["messages"])
    ]


def chitchat_conversations(split: Literal["train", "heldout"]) -> list[tuple[str, list[dict[str, str]]]]:
    """(conversation id, messages) of one split, in dataset order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    return [
        (cid, conversation_messages(conv))
        for cid, conv in _chitchat_raw().items()
        if is_heldout(cid) == want_heldout and conv.get("messages")
    ]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Sorted `**/*.py` files of the standard library, third-party folders excluded."""
    root = root or stdlib_root()
    return sorted(
        p for p in root.rglob("*.py")
        if p.is_file() and not ({"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    )
