"""Drafter-only replay of recorded greedy trajectories (SSSD's offline method; ArcticInference's simulator shape).

A trajectory is a prompt and the target's greedy output. Decoding steps start after the prefill token
(`output[0]`): at step t the drafter has seen prompt + output[:t] and drafts a tree under budget B; the step accepts
the longest root-to-node path that spells output[t:], yields accepted + 1 tokens (the bonus token is output[t+a]),
and the drafter is extended with those tokens. The rebuilt output equals the recorded one by construction, which the
replay asserts, so any drafter bug that breaks losslessness shows up here too.

tau = tokens produced by decoding steps / decoding steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafter.tree import DraftTree
from orchestrator.acceptance import accept
from tools.trajectories import Trajectory


CALIBRATION_BINS = 10


@dataclass
class ReplayResult:
    steps: int = 0
    tokens: int = 0
    draft_us: list[float] = field(default_factory=list)  # per step
    predicted_tokens: list[float] = field(default_factory=list)  # per step: sum(probs) + 1
    realized_tokens: list[int] = field(default_factory=list)  # per step: accepted + 1
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def draft_us_p50(self) -> float:
        return float(np.median(self.draft_us)) if self.draft_us else 0.0

    @property
    def calibration_mae(self) -> float:
        """Calibration error of the predicted tokens per step, relative to the realized mean.

        Steps are grouped into `CALIBRATION_BINS` equal-count bins by their prediction; per bin, |mean predicted -
        mean realized|; weighted by bin size. This is what the budget controller relies on: among steps predicted
        to yield x tokens, the mean yield is x. (A single step's yield is a random draw, so per-step errors, see
        `step_mae`, stay large even for a perfect predictor.)"""
        realized = np.asarray(self.realized_tokens, dtype=np.float64)
        predicted = np.asarray(self.predicted_tokens, dtype=np.float64)
        if realized.size == 0:
            return 0.0
        order = np.argsort(predicted, kind="stable")
        gaps = [abs(predicted[b].mean() - realized[b].mean()) * b.size
                for b in np.array_split(order, min(CALIBRATION_BINS, order.size))]
        return float(sum(gaps) / realized.size / max(realized.mean(), 1e-9))

    @property
    def step_mae(self) -> float:
        """Mean |predicted - realized| tokens over single steps, relative to the realized mean."""
        realized = np.asarray(self.realized_tokens, dtype=np.float64)
        predicted = np.asarray(self.predicted_tokens, dtype=np.float64)
        return float(np.abs(predicted - realized).mean() / max(realized.mean(), 1e-9)) if realized.size else 0.0


def target_tokens_for(tree: DraftTree, output: np.ndarray, t: int) -> np.ndarray:
    """What a greedy target answers at the root and every node: output[t + depth], -1 past the end."""
    positions = t + tree.position_offsets()
    return np.where(positions < output.shape[0], output[np.minimum(positions, output.shape[0] - 1)], -1).astype(np.int32)


def replay(
    drafter,
    trajectories: Sequence[Trajectory],
    *,
    budget: int,
    on_step=None,
) -> ReplayResult:
    """Replay every trajectory with `drafter` (start_request / extend / stop_request / draft API) at `budget`.

    `on_step(request_id, tree, accepted_nodes)` is called after every step (calibration logging). A drafter with an
    output history starts with it cleared, so it learns from this call's earlier trajectories only, never from
    another replay of the same ones.
    """
    clear_history = getattr(drafter, "clear_history", None)
    if clear_history is not None:
        clear_history()
    result = ReplayResult()
    for index, trajectory in enumerate(trajectories):
        output = trajectory.output_ids
        request_id = f"replay-{index}"
        drafter.start_request(request_id, np.concatenate([trajectory.prompt_ids, output[:1]]))
        rebuilt = [int(output[0])]
        t = 1
        while t < output.shape[0]:
            started = time.perf_counter()
            tree = drafter.draft([(request_id, budget)])[0]
            result.draft_us.append((time.perf_counter() - started) * 1e6)
            verdict = accept(tree, target_tokens_for(tree, output, t))
            produced = [int(x) for x in verdict.new_tokens if x >= 0][: output.shape[0] - t]
            rebuilt += produced
            result.steps += 1
            result.tokens += len(produced)
            result.predicted_tokens.append(tree.expected_accepted + 1.0)
            result.realized_tokens.append(len(verdict.accepted_nodes) + 1)
            result.tree_sizes.append(len(tree))
            if on_step is not None:
                on_step(request_id, tree, verdict.accepted_nodes)
            drafter.extend(request_id, np.asarray(produced, dtype=np.int32))
            t += len(produced)
        drafter.stop_request(request_id)
        if rebuilt != output.tolist():
            raise AssertionError(f"{trajectory.prompt_id}: replay rebuilt a different output (drafter or acceptance bug)")
    return result
