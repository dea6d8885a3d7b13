"""Recorded greedy trajectories: prompt token ids + the target model's greedy output, one JSON line per prompt.

Files live in `benchmarks/data/trajectories/<set>-<split>.jsonl` (committed, so drafter-only simulations, calibration
and the acceptance benchmark need no model), with a `<set>-<split>.meta.json` beside each saying how they were made.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

TRAJECTORY_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "trajectories"


@dataclass(frozen=True, eq=False)
class Trajectory:
    set_name: str
    prompt_id: str
    prompt_ids: np.ndarray  # int32 [prompt_len]
    output_ids: np.ndarray  # int32 [n_out]; output_ids[0] is the prefill's token
    finish_reason: str  # "eos" or "length"


T = TypeVar("T")


def spread(items: Sequence[T], n: int) -> list[T]:
    """`n` items evenly spaced over `items` (all of them when n >= len), first and last included.

    Benchmarks that serve a few prompts of a set take them this way, not the first n: the eval sets keep their
    source's order, and MT-Bench's is by category, so its first 8 questions are all "writing" of its 8 categories.
    """
    if n >= len(items):
        return list(items)
    if n <= 0:
        return []
    return [items[i] for i in np.linspace(0, len(items) - 1, n).round().astype(int)]


def trajectory_path(set_name: str, split: str, directory: Path = TRAJECTORY_DIR) -> Path:
    return directory / f"{set_name}-{split}.jsonl"


def save_trajectories(path: Path, trajectories: list[Trajectory], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for t in trajectories:
            row = {
                "set": t.set_name,
                "prompt_id": t.prompt_id,
                "prompt_ids": t.prompt_ids.tolist(),
                "output_ids": t.output_ids.tolist(),
                "finish_reason": t.finish_reason,
            }
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_trajectories(path: Path) -> list[Trajectory]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no recorded trajectories; run `python -m tools.record_trajectories` first")
    trajectories = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            trajectories.append(
                Trajectory(
                    set_name=row["set"],
                    prompt_id=row["prompt_id"],
                    prompt_ids=np.asarray(row["prompt_ids"], dtype=np.int32),
                    output_ids=np.asarray(row["output_ids"], dtype=np.int32),
                    finish_reason=row["finish_reason"],
                )
            )
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}:{line_no}: malformed trajectory line ({exc}); re-record this file") from exc
    return trajectories
