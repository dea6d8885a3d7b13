"""Speculation budget: how many draft-tree nodes each running request sends to verification this step.

Policies (`BudgetPolicy.parse`):
- `none`: plain decoding, zero nodes.
- `fixed:B`: B nodes per request (the most probable ones of its tree).
- `roofline`: SSSD's hardware rule, s = I_knee / b tokens per request (root included), I_knee = the step-time
  model's free budget (capped at 192 and rounded down to SSSD's grid), s rounded down to SSSD's grid.
- `goodput` (default): every request's tree is drafted up to a generous cap; then nodes of the whole batch are
  added in order of calibrated path probability while the predicted goodput

        goodput(k) = (b + sum of the k best node probabilities) / predicted_step_seconds(k)

  still rises, and the predicted step time stays within every request's TPOT objective. The expected tokens a
  request gets from a step are 1 (bonus) + the sum of its selected node probabilities, because `probs` are
  calibrated path-acceptance probabilities. When extra tokens cost as much as they are expected to return,
  k = 0: speculation turns itself off. An offline batch that only drains maximizes the time it saves instead
  (offline batches, below).

Node selection keeps trees valid: within a tree, probabilities never increase along a path and ties go to the
lower (earlier, parents-first) index, so the k best nodes of a tree always include their ancestors.

Closed loop (`observe`, called by the orchestrator after every step):
- acceptance: served traffic drifts from the offline calibration, and picking the highest-scored nodes of many
  trees selects the ones whose scores are most over-estimated (the winner's curse). Every verified node's outcome
  feeds an online recalibration by depth, source and probability bin (`orchestrator/recalibration.py`), and the
  allocation ranks, chooses and counts nodes by their recalibrated probability (a deep node can rank below a shallower
  sibling branch of lower calibrated probability: the chosen nodes are not always `prune_tree`'s). One realized /
  predicted ratio over all chosen nodes would let the over-estimated high-probability nodes shrink the marginal
  ones too, and one map for every depth would let the deep chains' compounding error shrink the shallow nodes;
- drafting cost: drafting runs on the same clock as verification (CPU here; SPIN-style overlap on GPUs hides it),
  so its measured seconds count in the goodput denominator. A step speculates only when the predicted goodput beats
  plain decoding by `min_gain` (2%: the corrections below take out the step-time model's bias, not its noise; at
  5%, MT-Bench at cap 4 decoded plainly on 45% of its steps while `fixed:4`, always speculating, was faster). Each
  drafted step's predicted gain over plain decoding without drafting (negative when nothing is sent: the drafting
  was wasted) enters a moving average over about `gain_window` (32) drafted steps; while it is negative,
  `draft_cap` returns 0 for a growing number of steps (2, 4, ... 32) and then probes again, so a saturated batch
  stops paying for drafts it will not send, while a lone request whose drafts pay on average keeps drafting through
  its unlucky steps. The window must span the gaps between such drafts: skipping saves at most the drafting (under
  1% of an 8B step on an H100, 0.24-0.29 ms against 26-39 ms in `gpu_orchestrator*.md`; about 2% of a cap-1 step on
  the AVX2 CPU), while a skipped hit loses its accepted tokens, and a probe is one step, so
  once backed off, rare drafts are rarely met again. Averaged over 5 drafted steps (the first rule), a lone
  request on an H100 whose drafter found a chain one step in 16 drafted on about half its steps and ran at 0.95x
  `fixed:16`'s tokens/s (`gpu_orchestrator_cap1_4a6d7bb.md`); averaged over 32, 1.00x (`gpu_orchestrator.md`).
  On the AVX2 CPU, side by side in the throughput benchmark (caps 1, 4 and 16 of every set; a one-off,
  `gain_window_ab_*.md`), 32 ran at 0.990-1.067x the tokens/s of 5, median 1.006. A probe drafts every running
  request: probing one in four halved the drafting at MT-Bench cap 16 on the Zen 2 (1.001x) but lost 1-2% at
  chitchat and grounded cap 16, where the nodes that pay at saturation come from a few requests that such a probe
  mostly misses (`zen2_oneoffs.txt` §8). The average is of predicted gains: speculating steps at MT-Bench cap 16 on
  the Zen 4 realized 0.85-0.92 of the tokens they predicted, so there the average stays positive and every step
  drafts (about 1% of the time). Averaging each drafted step's gain less its token shortfall instead started the
  back-off there (1.010x) but lost 2% at chitchat cap 16 (`zen4_oneoffs.txt` §1, §4): the probes' trade again.
  Backing off single requests (those whose drafts the allocation left out 8 steps in a row, past the roofline's
  knee) cut the drafting by 10-60% and moved throughput by -0.6% to +1.0% at cap 16, inside the ratio's run-to-run
  spread, and lost 4-6% at MT-Bench cap 4, below the knee (§7): not kept;
- drafting cap: the next step drafts at most twice the largest tree the controller just chose (at least 8), so large
  batches do not draft 64 nodes per request to send two;
- marginal cost: goodput hinges on what the speculated tokens add to a plain step, which a global least-squares fit
  can get wrong at the current operating point. Measured / predicted time of plain steps (`plain_scale`, a moving
  average) is tracked, and over speculating steps a decayed least-squares line of measured on predicted extra time
  (both relative to the plain step): its intercept `speculation_overhead` is what any speculating step costs on top
  (tree masks, positions, an extra attention call: 3 ms of a 40 ms step at cap 4 on the CPU), its slope
  `marginal_scale` what each predicted second of extra tokens costs. A slope alone would charge that fixed overhead
  to every node, and the smaller the trees the more (it measured 1.5-1.9 at cap 4 where nodes cost 1.15 each).
  Only speculating steps measure the line, so while no step speculates it forgets toward the step-time model's own
  prediction (y = x) at a quarter of the EMA rate. Without that, a line made pessimistic by a burst of background
  load stops speculation for good; the likely cause of HumanEval's cap-16 row on the AVX-512 CPU (0.4 nodes per
  request-step, 0.78 of `fixed:4`, `throughput.md` at f281b0f; 0.94 in the full re-run at 7641bc3, so the cause
  was an event, not the policy's steady state). With it speculation resumes within tens of steps, and
  where speculating really costs that much, a probe every ~30 steps measures again;
- the engine's attention layout (`StepTimeModel.attention_layout`): on an engine that pads every request of a step
  to the deepest tree, the candidate that deepens the deepest tree costs attention rows for every request, so the
  allocation spreads nodes across requests unless one request's nodes are worth that. An engine that groups
  requests of similar shape into separate calls (`TorchEngine`) is priced per request, as a packed one, while
  choosing; the chosen step's prediction uses the engine's grouping. On a grouped engine the best prefix is then
  compared, at the engine's grouping, with allocations that cap every request at L nodes (L = 1, 2, 4, ...), since
  a few deep trees among shallow ones pad the calls they share;
- offline batches (`remaining_steps` and `tokens_per_step`, passed by an `Orchestrator(offline_batch=True)` once no
  request waits): the job ends when its slowest request does, so the objective is the drain's time, not this step's
  throughput (`_DrainTime`): the seconds of future steps that the chosen nodes' expected tokens save, minus what they
  add to this step. The drain's time left is about fixed * (the slowest request's steps left) + row * (every
  request's steps left), so a token saves one row for any request and, for the request that finishes last, the
  fixed part of a tail step as well (`_drain_token_seconds`; both constants come from the corrected plain step).
  Greedy goodput otherwise finishes the easy requests first and leaves the hard ones to a long, nearly empty tail
  (grounded set, cap 16: about 40% of the run's time with fewer than 16 requests running, against a third for
  `fixed:4`). The rule before this one weighed each request's tokens by its steps left relative to the slowest's
  inside the throughput ratio. That still paid for nodes on requests far from the tail, where a token saves one
  row and its verify row costs about as much, and it priced the slowest request's nodes at this step's time shared
  over the weights instead of the tail step they save. Known limit: drafts that hit unevenly part the requests'
  finishing times, so a goodput batch drains through a tail of small steps that `none`, whose requests finish in
  lockstep, never runs. Where speculation's per-step gain is thin (the AVX2 CPU at MT-Bench cap 16: plain batch-16
  steps near the machine's limits, low acceptance) goodput sits at about `none`'s throughput, within the
  run-to-run noise of that group (`throughput_avx2.md`; each earlier round's figure is in the git log).

- per-request ceiling: at most max(4, T / b) nodes per request, T = the larger of `batch_node_ceiling` (64) and
  the roofline's free token budget (SSSD's knee: ~12 tokens on this CPU, ~295 for bf16 on an H100). The calibrated
  values of one request's deep and lower-ranked nodes are over-rated next to other requests' first nodes, so in a
  large batch the greedy order gave lucky requests deep trees and others none, and realized less than `fixed:4`
  from as many nodes (grounded set, cap 32: 3.7 nodes per request-step and tau 2.67 against 4.0 and 2.90; 0.95 of
  `fixed:4`'s throughput). Measured side by side with it (`benchmarks/results/throughput_node_ceiling.md`), goodput
  made 1.002 of `fixed:4`'s throughput at grounded cap 32 and 0.975 at cap 16 (0.949 and 0.961 before). For a lone
  request the ceiling is the drafting cap itself (64), and drafting never asks for more (`draft_cap`).

Opt-in (`per_request_acceptance=True`): each request's node probabilities are scaled by its own realized / predicted
(recalibrated) accepted tokens so far, shrunk toward 1 (SpecServe §4).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numba as nb
import numpy as np

from drafter.tree import DraftTree
from orchestrator.recalibration import OnlineRecalibration, recalibrated_values
from orchestrator.roofline import StepTimeModel, prefix_step_seconds

_SSSD_KNEES = (16, 32, 48, 64, 96, 128, 160, 192)
_SSSD_SPEC_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


@dataclass(frozen=True)
class BudgetPolicy:
    kind: str = "goodput"
    fixed_nodes: int = 0
    max_nodes_per_request: int = 64  # the drafting cap for `goodput`, and an upper bound for every policy

    @classmethod
    def parse(cls, text: str, *, max_nodes_per_request: int = 64) -> "BudgetPolicy":
        kind, _, arg = text.partition(":")
        if kind == "fixed":
            if not arg.isdigit() or int(arg) < 1:
                raise ValueError(f"policy {text!r}: `fixed:B` needs a whole number of nodes B >= 1, e.g. fixed:16")
            return cls("fixed", int(arg), max(max_nodes_per_request, int(arg)))
        if kind in ("none", "roofline", "goodput") and not arg:
            return cls(kind, 0, max_nodes_per_request)
        raise ValueError(f"unknown budget policy {text!r}: use none, fixed:B, roofline or goodput")

    def __str__(self) -> str:
        return f"fixed:{self.fixed_nodes}" if self.kind == "fixed" else self.kind


@dataclass(frozen=True)
class BudgetDecision:
    nodes: np.ndarray  # int32 [b]: nodes sent per request
    predicted_step_s: float
    predicted_tokens: np.ndarray  # float64 [b]: 1 + sum of selected node probabilities (recalibrated: closed loop)
    no_speculation_step_s: float  # predicted time of the same step with zero nodes
    gain: float = 0.0  # goodput: predicted goodput (drafting included) / plain decoding's without drafting, minus 1
    request_ids: tuple | None = None  # the requests, in order, when the caller named them
    node_probs: np.ndarray | None = None  # calibrated probabilities of the sent nodes: request by request, tree order
    node_depths: np.ndarray | None = None  # and their depths, in the same order
    node_sources: np.ndarray | None = None  # and their drafter sources (0: the request's own index), same order


def prune_tree(tree: DraftTree, n: int) -> DraftTree:
    """The `n` most probable nodes of `tree` (ties: lower index), parents-first; always a valid tree."""
    if n >= len(tree):
        return tree
    if n <= 0:
        return DraftTree.empty()
    if tree.probs[:n].min() >= tree.probs[n:].max():
        # the drafter's usual order (most probable first): the first n nodes are the n best, ties to the lower index
        return tree.prefix(n)
    # stable argsort of -probs: ties keep the lower index, so every kept node's ancestors are kept too
    return tree.subtree(np.sort(np.argsort(-tree.probs, kind="stable")[:n]))


def _keep_nodes(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The nodes `keep` (closed under ancestors, any order) of `tree`."""
    n = keep.size
    if n == len(tree):
        return tree
    if n == 0:
        return DraftTree.empty()
    keep = np.sort(keep)
    return tree.prefix(n) if keep[-1] == n - 1 else tree.subtree(keep)  # the first n nodes: the usual case


class BudgetController:
    def __init__(self, policy: BudgetPolicy, step_model: StepTimeModel, *, min_gain: float = 0.02,
                 ema: float = 0.1, per_request_acceptance: bool = False, prior_tokens: float = 4.0,
                 batch_node_ceiling: int = 64, gain_window: int = 32) -> None:
        self.policy = policy
        self.step_model = step_model
        self.min_gain = min_gain
        if batch_node_ceiling < 1:
            raise ValueError(f"batch_node_ceiling must be >= 1; got {batch_node_ceiling}")
        self.batch_node_ceiling = batch_node_ceiling
        self.ema = ema
        if isinstance(gain_window, bool) or not isinstance(gain_window, int) or gain_window < 1:
            raise ValueError(f"gain_window must be an int >= 1 (drafted steps); got {gain_window!r}")
        self.gain_window = gain_window
        # Per-request acceptance (SpecServe §4), opt-in: a request whose drafts keep beating (or missing) their
        # calibrated probabilities gets its own factor, shrunk toward the batch-wide scale by `prior_tokens` predicted
        # tokens. Off by default: side by side on the CPU benchmark it was no better than the batch-wide scale
        # (within run-to-run noise at cap 4, slightly worse at cap 1).
        self.per_request_acceptance = per_request_acceptance
        self.prior_tokens = prior_tokens
        self._history: dict = {}  # request id -> [predicted (recalibrated), realized draft tokens] so far
        # closed-loop state (goodput policy)
        self.recalibration = OnlineRecalibration()
        self._draft_s_per_request: deque[float] = deque(maxlen=16)  # recent drafting seconds per request
        self._next_cap = policy.max_nodes_per_request
        self._skip_steps = 0
        self._backoff = 0
        self._gain = 0.0  # EMA of `BudgetDecision.gain` over drafted steps
        # Measured / predicted step time of plain steps, and measured / predicted cost of the speculated tokens on
        # top of them: the goodput decision hinges on that marginal cost, which a global fit can get wrong locally.
        self.plain_scale = 1.0
        self.marginal_scale = 1.0
        self.speculation_overhead = 0.0  # of a plain step
        # Intercept and slope: least squares of (measured - plain) on (predicted - plain) over recent speculating
        # steps, from exponentially decayed sums [1, x, y, x^2, xy] (a ratio per step would divide timing noise by
        # the small predicted extra of a step that sends few nodes). The sums start as two pseudo-steps on the line
        # y = x (5% and 15% extra), so the first speculating steps cannot swing it far; they fade like the data.
        self._cost_sums = _COST_PRIOR.copy()
        self._drafted_steps = 0  # no back-off during the first steps: cold caches make the first drafts slow
        _warm_up_kernels(step_model)

    @property
    def acceptance_scale(self) -> float:
        """Realized / calibrated accepted draft tokens over recent steps, all probability bins together (reports)."""
        return self.recalibration.scale

    @property
    def draft_s_per_request(self) -> float:
        """Median of recent drafting seconds per request (robust to a slow first call or a noisy step)."""
        return statistics.median(self._draft_s_per_request) if self._draft_s_per_request else 0.0

    def draft_cap(self, num_running: int) -> int:
        """Nodes per request to ask the drafter for before allocation."""
        p = self.policy
        if p.kind == "none" or num_running == 0:
            return 0
        if p.kind == "fixed":
            return p.fixed_nodes
        if p.kind == "roofline":
            return self.roofline_nodes(num_running)
        if self._skip_steps > 0:
            self._skip_steps -= 1
            return 0
        return min(self._next_cap, p.max_nodes_per_request, self.node_ceiling(num_running))  # `allocate` sends no more

    def request_factors(self, request_ids: Sequence | None, b: int) -> np.ndarray:
        """Per request, a factor on its recalibrated node probabilities: 1, or with `per_request_acceptance` its own
        realized / predicted accepted tokens so far, shrunk toward 1 by `prior_tokens`."""
        if request_ids is None or not self.per_request_acceptance:
            return np.ones(b)
        c = self.prior_tokens
        history = [self._history.get(rid, (0.0, 0.0)) for rid in request_ids]
        return np.array([np.clip((realized + c) / (predicted + c), 0.25, 2.0) for predicted, realized in history])

    def observe(self, decision: "BudgetDecision", *, accepted: np.ndarray, draft_s: float, cap: int,
                measured_s: float | None = None) -> None:
        """Feed back one step: which sent nodes were accepted (1/0 per node, in `decision.node_probs`' order), the
        drafting time it cost and the measured verify time."""
        if self.policy.kind != "goodput":
            return
        accepted = np.asarray(accepted, dtype=np.float64)
        probs = decision.node_probs if decision.node_probs is not None else np.zeros(0)
        depths = decision.node_depths if decision.node_depths is not None else np.ones(probs.shape, np.int32)
        sources = decision.node_sources
        if accepted.shape != probs.shape:
            raise ValueError(f"accepted has {accepted.shape[0]} entries; the decision sent {probs.shape[0]} nodes")
        if self.per_request_acceptance and decision.request_ids is not None:
            live = set(decision.request_ids)
            self._history = {rid: h for rid, h in self._history.items() if rid in live}  # finished ones leave
            owner = np.repeat(np.arange(len(decision.nodes)), decision.nodes)
            predicted = np.bincount(owner, weights=self.recalibration(probs, depths, sources),
                                    minlength=len(decision.nodes))
            realized = np.bincount(owner, weights=accepted, minlength=len(decision.nodes))
            for rid, n, p, r in zip(decision.request_ids, decision.nodes, predicted, realized):
                if n > 0:
                    h = self._history.setdefault(rid, [0.0, 0.0])
                    h[0] += float(p)
                    h[1] += float(r)
        self.recalibration.observe(probs, depths, accepted, sources)
        b = max(len(decision.nodes), 1)
        a = self.ema
        if measured_s and measured_s > 0 and decision.no_speculation_step_s > 0:
            base = decision.no_speculation_step_s
            if decision.nodes.sum() == 0:
                self.plain_scale = (1 - a) * self.plain_scale + a * min(max(measured_s / base, 0.25), 4.0)
                # Only speculating steps measure the cost line, so a line made pessimistic by a burst of background
                # load would otherwise stop speculation for good: it forgets toward its prior (the step-time model,
                # itself refit online) while no step speculates, and the next probe measures again.
                self._cost_sums = (1 - a / 4) * self._cost_sums + a / 4 * _COST_PRIOR
            elif decision.predicted_step_s > base * 1.001:
                x = (decision.predicted_step_s - base) / base
                y = (measured_s - self.plain_scale * base) / base
                self._cost_sums = (1 - a) * self._cost_sums + a * np.array([1.0, x, y, x * x, x * y])
            self.speculation_overhead, self.marginal_scale = _speculation_cost_line(self._cost_sums)
        if cap > 0:
            self._draft_s_per_request.append(draft_s / b)
            w = 1.0 / self.gain_window
            self._gain = (1 - w) * self._gain + w * decision.gain
            self._drafted_steps += 1
            if self._gain >= 0 or self._drafted_steps < 8:
                self._backoff = 0
                self._next_cap = max(8, 2 * int(decision.nodes.max()))
            else:  # back off drafting; probe again after 2, 4, ... 32 steps
                self._backoff = min(max(2 * self._backoff, 2), 32)
                self._skip_steps = self._backoff
                self._next_cap = max(8, self._next_cap // 2)

    def node_ceiling(self, batch: int) -> int:
        """The most nodes `goodput` sends for one request of a batch of `batch` (module docstring)."""
        share = max(float(self.batch_node_ceiling), self.step_model.free_budget())
        return max(4, int(share // max(batch, 1)))

    def roofline_nodes(self, batch: int) -> int:
        """SSSD's s = I_knee // b (root included), capped per batch size and snapped to SSSD's grid; minus the root."""
        knee = min(self.step_model.free_budget(), 192)
        knee = max([k for k in _SSSD_KNEES if k <= knee], default=_SSSD_KNEES[0])
        cap = 32 if batch <= 1 else 64 // batch if batch <= 3 else 96 // batch if batch <= 6 else 512 // batch
        s = min(knee // batch, cap)
        s = max([v for v in _SSSD_SPEC_LENGTHS if v <= s], default=1)
        return min(s - 1, self.policy.max_nodes_per_request)

    def allocate(
        self,
        trees: Sequence[DraftTree],
        context: np.ndarray,
        *,
        tpot_s: np.ndarray | None = None,
        request_ids: Sequence | None = None,
        remaining_steps: np.ndarray | None = None,
        tokens_per_step: np.ndarray | None = None,
    ) -> tuple[list[DraftTree], BudgetDecision]:
        """Choose the nodes each request verifies this step; returns pruned trees and the decision. `request_ids`
        (in the trees' order) lets `goodput` weigh each request by its own realized acceptance. `remaining_steps`
        (per request, given while an offline batch drains; `tokens_per_step`: each request's rate so far, default 1):
        `goodput` then values each request's tokens by the future step time they save (`_drain_token_seconds`)."""
        b = len(trees)
        context = np.asarray(context, dtype=np.float64)
        ones = np.ones(b)
        base_s, plain_calls = self.step_model.plain_step(context)
        if self.policy.kind != "goodput":
            cap = self.draft_cap(b)
            pruned = [prune_tree(t, cap) for t in trees]
            nodes = np.array([len(t) for t in pruned], dtype=np.int32)
            raw = np.array([t.expected_accepted for t in pruned])
            return pruned, BudgetDecision(nodes, self.step_model.predict(ones + nodes, context), ones + raw, base_s,
                                          node_probs=_node_probs(pruned), node_depths=_node_depths(pruned),
                                          node_sources=_node_sources(pruned))

        if not any(len(t) for t in trees):  # nothing drafted (drafting backed off, or found nothing): a plain step
            return list(trees), self._plain_decision(context, base_s, plain_calls, request_ids)
        ceiling = self.node_ceiling(b)
        trees = [prune_tree(t, ceiling) for t in trees]
        candidates = (_node_probs(trees), _node_depths(trees), _node_sources(trees))  # every node, request by request
        factors = self.request_factors(request_ids, b)
        draft_s = self.draft_s_per_request * b
        if remaining_steps is None:
            objective: _Objective = _Throughput(draft_s, ones)
        else:
            rate = ones if tokens_per_step is None else np.maximum(np.asarray(tokens_per_step, np.float64), 1.0)
            seconds = self._drain_token_seconds(np.asarray(remaining_steps, np.float64), rate, context, base_s)
            objective = _DrainTime(draft_s, seconds)
        nodes, step_s, tokens, gain, kept = self._goodput_nodes(trees, candidates, context, tpot_s, factors,
                                                                objective, base_s, plain_calls)
        # `kept` is sorted and the trees lie end to end, so each request's share is one run of it
        pruned, start, end = [], 0, 0
        for tree, n in zip(trees, nodes.tolist()):
            pruned.append(_keep_nodes(tree, kept[end : end + n] - start))
            start += len(tree)
            end += n
        probs, depths, sources = candidates
        return pruned, BudgetDecision(nodes, step_s, tokens, base_s, gain,
                                      request_ids=None if request_ids is None else tuple(request_ids),
                                      node_probs=probs[kept], node_depths=depths[kept], node_sources=sources[kept])

    def _drain_token_seconds(self, remaining_steps: np.ndarray, tokens_per_step: np.ndarray, context: np.ndarray,
                             base_s: float) -> np.ndarray:
        """Per request, the future step time one more accepted token saves while an offline batch drains.

        The drain's remaining time is about sum over its future steps of (fixed + rows * row), i.e.
        fixed * (the slowest request's steps left) + row * (everyone's steps left). A token takes 1 / rate of a step
        off its request: one row's time for any request, plus the fixed part of a step for the one that finishes
        last (shared by a softmax over the requests' steps left, below: requests level with the slowest must all
        shorten before the tail does). The constants come from the corrected plain-step model: this step's time at
        b rows and the slowest request's step alone."""
        b = remaining_steps.shape[0]
        slowest = int(np.argmax(remaining_steps))
        step_b = self.plain_scale * base_s
        step_1 = step_b if b == 1 else self.plain_scale * self.step_model.predict(np.ones(1),
                                                                                 context[slowest:slowest + 1])
        row = max(step_b - step_1, 0.0) / (b - 1) if b > 1 else 0.0
        fixed = max(step_1 - row, 0.0)
        # which request finishes last is uncertain: its steps left drift by about their square root as drafts hit
        # or miss, so the tail's fixed part is shared by a softmax over that spread
        spread = max(1.0, float(np.sqrt(remaining_steps[slowest])))
        last = np.exp((remaining_steps - remaining_steps[slowest]) / spread)
        return (row + fixed * last / last.sum()) / tokens_per_step

    def _plain_decision(self, context: np.ndarray, base_s: float, plain_calls: float,
                        request_ids: Sequence | None) -> BudgetDecision:
        """`_goodput_nodes`' answer when there is no candidate, without its machinery (half a millisecond per step
        before 9fe0ad3, a few hundred microseconds since, which a backed-off batch would pay for nothing): zero
        nodes, and the gain of a plain step that paid for drafting, `plain / (plain + drafting) - 1`."""
        b = context.shape[0]
        grouped = self.step_model.attention_layout == "grouped"
        # the prefix curve's plain step: priced packed, which only a grouped layout prices differently from `predict`
        if grouped:
            model_s = float(self._prefix_seconds(np.zeros(0, np.int64), np.zeros(0), context, plain_calls)[0])
        else:
            model_s = base_s
        step_s = self.plain_scale * model_s
        draft_s = self.draft_s_per_request * b
        gain = step_s / (step_s + draft_s) - 1.0 if step_s + draft_s > 0 else 0.0
        return BudgetDecision(np.zeros(b, np.int32), base_s, np.ones(b), base_s, gain,
                              request_ids=None if request_ids is None else tuple(request_ids), node_probs=np.zeros(0),
                              node_depths=np.zeros(0, np.int32), node_sources=np.zeros(0, np.int16))

    def _goodput_nodes(self, trees, candidates, context, tpot_s, factors, objective: "_Objective", plain_s,
                       plain_calls):
        """The chosen nodes: per request their count, the step's predicted seconds and expected tokens, the gain, and
        where the chosen nodes sit in `candidates` (the node arrays of `trees`, request by request; sorted), in
        that order."""
        b = len(trees)
        model = self.step_model
        # Candidates of the whole batch, best first by expected accepted tokens (the request's factor times the
        # node's recalibrated path probability, at most 1). Values never rank a child above its parent and one factor
        # scales a whole tree, so every prefix of this order holds whole trees (ties: parents first). A node's worth
        # to the objective (`value`) orders them; `probs` stay the predictions. `gain` compares the result with
        # plain decoding that drafts nothing, which steers the next steps' drafting.
        sizes = np.array([len(t) for t in trees], dtype=np.int64)
        tpot_limit = _tpot_limit(tpot_s)
        cost_terms = self._cost_terms()
        owner, probs, value, index, rank_in_owner, expected, model_s, step_s, goodput = _goodput_curve(
            sizes, np.concatenate([t.parents for t in trees] + [np.empty(0, np.int32)]), *candidates,
            *self.recalibration.maps(), np.ascontiguousarray(factors, dtype=np.float64),
            np.ascontiguousarray(objective.token_worth, dtype=np.float64), *model.prefix_pricing(), context,
            plain_calls, cost_terms, objective.drain, objective.plain_worth, objective.draft_s, tpot_limit)
        k = int(goodput.argmax())  # first maximum: the fewest nodes that reach the best goodput
        keep = np.arange(k)  # positions in the candidate order of the chosen nodes
        best = goodput[k]
        priced: dict[bytes, float] = {}  # grouped: model seconds by tokens per request (prefixes often agree on them)
        if model.attention_layout == "grouped" and b > 1 and k > 0:
            # The prefix curve prices each request's attention alone (packed). The engine pads every request of an
            # SDPA call to the call's deepest tree, so a few deep trees in a batch of shallow ones cost more than
            # that (the step-time model fitted on the CPU's grounded-set steps at cap 32 prices 48 nodes on 6 of 32
            # requests at 76% of the extra time of 128 nodes spread evenly; priced packed, 53%). So the
            # best prefix is compared, at the engine's own grouping, with orders that cap every request at L nodes
            # (L = 1, 2, 4, 8): each one's best prefix and the whole of it (every request's best L nodes: one
            # shape, one call). Small batches too: every call beyond one per layer costs host work (the step-time
            # model's `attention_calls` feature; ~4 ms of a 75 ms step at batch 4 on the CPU), which the packed
            # pricing cannot see: at cap 4, goodput's uneven trees took 4 calls where `fixed:4`'s took one.
            best = self._grouped_goodput(keep, owner, expected[k], context, objective, tpot_limit, plain_s,
                                         cost_terms, priced)
            for cap in (1, 2, 4, 8):
                within = np.flatnonzero(rank_in_owner < cap)
                sub_expected = objective.plain_worth + np.concatenate([[0.0], np.cumsum(value[within])])
                sub_s = self._prefix_seconds(owner[within], rank_in_owner[within], context, plain_calls)
                sub_goodput = _score_curve(sub_s, sub_expected, cost_terms, objective.drain,
                                           objective.draft_s, tpot_limit)[1]
                for sub_k in {int(np.argmax(sub_goodput)), within.size} - {0}:
                    candidate = self._grouped_goodput(within[:sub_k], owner, sub_expected[sub_k], context, objective,
                                                      tpot_limit, plain_s, cost_terms, priced)
                    if candidate > best:
                        best, keep = candidate, within[:sub_k]
                if cap > rank_in_owner.max(initial=0):
                    break
        if objective.excess(best, goodput[0], step_s[0]) < self.min_gain:
            keep = np.arange(0)
            best = goodput[0]
        gain = objective.gain(best, expected[0], step_s[0])
        nodes, expected_tokens, kept = _chosen(keep, owner, probs, index, sizes)
        if model.attention_layout != "grouped":
            predicted_s = float(model_s[keep.size])
        else:  # the grouped comparisons may have priced it already
            tokens = 1.0 + nodes
            key = tokens.tobytes()
            predicted_s = priced[key] if key in priced else model.predict(tokens, context)
        return nodes, predicted_s, expected_tokens, gain, kept

    def _prefix_seconds(self, owner: np.ndarray, rank_in_owner: np.ndarray, context: np.ndarray,
                        plain_calls: float) -> np.ndarray:
        """Model seconds of the step after adding the first k candidates (k = 0..len(owner))."""
        return self.step_model.prefix_seconds(context, context[owner], rank_in_owner, plain_calls)

    def _cost_terms(self) -> np.ndarray:
        """[plain_scale, marginal_scale, speculation_overhead]: how `_speculating_seconds` corrects model seconds."""
        return np.array([self.plain_scale, self.marginal_scale, self.speculation_overhead])

    def _grouped_goodput(self, keep, owner, expected, context, objective: "_Objective", tpot_limit: float, plain_s,
                         cost_terms: np.ndarray, priced: dict) -> float:
        """Goodput of sending the candidates at positions `keep`, priced at the engine's own attention grouping."""
        tokens = 1.0 + np.bincount(owner[keep], minlength=context.shape[0])
        key = tokens.tobytes()
        if key not in priced:
            priced[key] = self.step_model.predict(tokens, context)
        seconds = _speculating_seconds(priced[key], plain_s, cost_terms)
        if seconds > tpot_limit:
            return -np.inf
        return float(_score(expected, seconds, objective.drain, objective.draft_s))


@dataclass(frozen=True)
class _Throughput:
    """The step's tokens per second, drafting included: `goodput`'s objective wherever more work may follow."""

    draft_s: float  # this step's drafting: already spent whatever is chosen, so it stays in the denominator
    token_worth: np.ndarray  # per request, what one expected token is worth (1: every token alike)

    drain = False  # `_score`: expected / (step_s + draft_s)

    @property
    def plain_worth(self) -> float:
        return float(self.token_worth.sum())

    def excess(self, best: float, plain: float, plain_step_s: float) -> float:
        return best / plain - 1.0

    def gain(self, best: float, plain_expected: float, plain_step_s: float) -> float:
        """Against plain decoding that drafts nothing."""
        return float(best * plain_step_s / plain_expected - 1.0)


@dataclass(frozen=True)
class _DrainTime:
    """Seconds of future steps the step's expected tokens save, minus its own time: an offline batch's objective once
    nothing waits. The job then ends with its slowest request, so tokens are worth the time they take off the drain
    (`BudgetController._drain_token_seconds`), not a share of this step's throughput."""

    draft_s: float
    token_worth: np.ndarray  # per request, seconds one expected token saves

    plain_worth = 0.0  # the plain token each request gets is the same whatever is chosen
    drain = True  # `_score`: expected - step_s

    def excess(self, best: float, plain: float, plain_step_s: float) -> float:
        return (best - plain) / (plain_step_s + self.draft_s)

    def gain(self, best: float, plain_expected: float, plain_step_s: float) -> float:
        """Against plain decoding that drafts nothing: the seconds saved net of drafting, per plain step."""
        return float((best - (plain_expected - plain_step_s) - self.draft_s) / plain_step_s)


_Objective = _Throughput | _DrainTime


# The cost line's prior, as decayed sums [1, x, y, x^2, xy]: two half-weight pseudo-steps on y = x (5% and 15% extra).
_COST_PRIOR = np.array([1.0, 0.1, 0.1, 0.0125, 0.0125])


def _speculation_cost_line(sums: np.ndarray) -> tuple[float, float]:
    """Intercept >= 0 and slope in [0.25, 8] of y on x from decayed sums [1, x, y, x^2, xy], with a light ridge
    toward (0, 1) so that steps of one size (an intercept and a slope cannot be told apart) stay solvable."""
    n, sx, sy, sxx, sxy = sums.tolist()  # Python floats: the same arithmetic, without numpy's per-scalar overhead
    ridge_intercept, ridge_slope = 1e-6, 1e-6
    det = (n + ridge_intercept) * (sxx + ridge_slope) - sx * sx
    intercept = (sy * (sxx + ridge_slope) - sx * (sxy + ridge_slope)) / det
    slope = ((n + ridge_intercept) * (sxy + ridge_slope) - sx * sy) / det
    if intercept < 0:  # speculating cannot make a step cheaper than plain: a line through the origin
        intercept, slope = 0.0, (sxy + ridge_slope) / (sxx + ridge_slope)
    return min(intercept, 1.0), min(max(slope, 0.25), 8.0)


def _tpot_limit(tpot_s: np.ndarray | None) -> float:
    """The step seconds no request's TPOT objective allows to exceed (inf: none is set)."""
    if tpot_s is not None and np.isfinite(tpot_s).any():
        return float(np.nanmin(tpot_s))
    return np.inf


def _end_to_end(arrays: list[np.ndarray], dtype) -> np.ndarray:
    """Per-tree arrays laid end to end as `dtype`; a lone tree's own array, not a copy, where it already is one."""
    if len(arrays) == 1 and arrays[0].dtype == dtype:
        return arrays[0]
    return np.concatenate(arrays + [np.empty(0, dtype)]).astype(dtype, copy=False)


def _node_probs(trees: Sequence[DraftTree]) -> np.ndarray:
    return _end_to_end([t.probs for t in trees], np.float64)


def _node_depths(trees: Sequence[DraftTree]) -> np.ndarray:
    return _end_to_end([t.depth for t in trees], np.int32)


def _node_sources(trees: Sequence[DraftTree]) -> np.ndarray:
    return _end_to_end([t.source for t in trees], np.int16)


_kernels_ready = False  # set by the first controller of the process (`_warm_up_kernels`)


def _warm_up_kernels(step_model: StepTimeModel) -> None:
    """Compile (or load from numba's on-disk cache) the numba functions of a goodput step now: the allocation's, the
    recalibration's and the step-time model's, on a throwaway controller (a clone of `step_model`), so that no
    request pays for it, as `Drafter` does for its own. In a fresh install the first goodput step of a process
    otherwise spent ~6 s compiling (2-core AVX2 EPYC: `benchmarks/throughput.py`'s `warm_up`). Once per process;
    the controller being built is not touched."""
    global _kernels_ready
    if _kernels_ready:
        return
    _kernels_ready = True  # first: the throwaway controller below comes through here too
    controller = BudgetController(BudgetPolicy.parse("goodput"), step_model.clone())
    trees = [DraftTree.from_arrays(tokens=[1, 2, 3], parents=[-1, 0, 0], probs=[0.9, 0.6, 0.2], source=[0, 1, 0]),
             DraftTree.from_arrays(tokens=[4, 5], parents=[-1, 0], probs=[0.8, 0.7])]
    context = np.array([64, 256])
    _, decision = controller.allocate(trees, context, tpot_s=np.array([1.0, np.inf]), request_ids=["a", "b"])
    controller.observe(decision, accepted=np.ones(decision.node_probs.shape), draft_s=1e-3, cap=8,
                       measured_s=decision.predicted_step_s)
    controller.allocate(trees, context, request_ids=["a", "b"], remaining_steps=np.array([10.0, 3.0]))


@nb.njit(cache=True)
def _batch_layout(sizes, local_parents):
    """The candidates of trees laid end to end (`sizes` nodes each): each node's request and its parent's index in
    the whole batch (-1 for a child of its root)."""
    owner = np.empty(local_parents.shape[0], np.int64)
    parents = np.empty(local_parents.shape[0], np.int64)
    start = 0
    for b in range(sizes.shape[0]):
        for i in range(start, start + sizes[b]):
            owner[i] = b
            parents[i] = local_parents[i] + start if local_parents[i] >= 0 else -1
        start += sizes[b]
    return owner, parents


@nb.njit(cache=True)
def _order_candidates(owner, sizes, values, factors, token_worth):
    """`_goodput_nodes`' candidate order in one compiled call (as array operations it was a dozen calls, each a
    few microseconds, on every step): each node's predicted acceptance `probs` (its request's factor times its
    recalibrated value, at most 1) and worth `value` (times its request's token worth), sorted by worth, best first
    and stable (ties keep the layout: by request, parents first). Returns, in that order, each candidate's request,
    probs, value, index within its tree and rank within its request, and the cumulative worth of every prefix
    (0 first)."""
    n = owner.shape[0]
    starts = np.zeros(sizes.shape[0], np.int64)
    for b in range(1, sizes.shape[0]):
        starts[b] = starts[b - 1] + sizes[b - 1]
    probs = np.empty(n)
    negative = np.empty(n)
    for i in range(n):
        probs[i] = min(factors[owner[i]] * values[i], 1.0)
        negative[i] = -(token_worth[owner[i]] * probs[i])
    order = np.argsort(negative, kind="mergesort")  # stable
    sorted_owner = np.empty(n, np.int64)
    sorted_probs = np.empty(n)
    value = np.empty(n)
    index = np.empty(n, np.int64)
    rank = np.empty(n)
    cumulative = np.empty(n + 1)
    cumulative[0] = 0.0
    seen = np.zeros(sizes.shape[0], np.int64)
    for k in range(n):
        i = order[k]
        o = owner[i]
        sorted_owner[k] = o
        sorted_probs[k] = probs[i]
        value[k] = -negative[i]
        index[k] = i - starts[o]
        rank[k] = seen[o]
        seen[o] += 1
        cumulative[k + 1] = cumulative[k] + value[k]
    return sorted_owner, sorted_probs, value, index, rank, cumulative


@nb.njit(cache=True)
def _speculating_seconds(model_s, plain_s, cost_terms):
    """What a step of `model_s` model seconds that speculates (`plain_s`: the same step with no nodes) takes: the
    plain step and the speculated tokens on top, corrected by what such steps measured (`BudgetController._cost_terms`:
    the plain steps' scale, the cost line's slope and intercept)."""
    return cost_terms[0] * plain_s + cost_terms[1] * (model_s - plain_s) + cost_terms[2] * plain_s


@nb.njit(cache=True)
def _score(expected, step_s, drain, draft_s):
    """The objective of a step of `step_s` seconds expected to return `expected`: tokens per second, drafting
    included (`_Throughput`), or the seconds the tokens save net of the step's own (`_DrainTime`)."""
    return expected - step_s if drain else expected / (step_s + draft_s)


@nb.njit(cache=True)
def _score_curve(model_s, expected, cost_terms, drain, draft_s, tpot_limit):
    """Each prefix's corrected step seconds and score (`model_s[k]`, `expected[k]`: the first k candidates'; 0: no
    nodes). A prefix whose step would exceed `tpot_limit` scores -inf, except the plain step: never refuse to decode."""
    n = model_s.shape[0]
    step_s = np.empty(n)
    score = np.empty(n)
    for k in range(n):
        step_s[k] = cost_terms[0] * model_s[0] if k == 0 else _speculating_seconds(model_s[k], model_s[0], cost_terms)
        score[k] = _score(expected[k], step_s[k], drain, draft_s)
        if k > 0 and not step_s[k] <= tpot_limit:
            score[k] = -np.inf
    return step_s, score


@nb.njit(cache=True)
def _goodput_curve(sizes, local_parents, node_probs, node_depths, node_sources, bucket_starts, knots_x, knots_y,
                   factors, token_worth, rates, rows_table, n_layers, padded, coefficients, context, attention_calls,
                   cost_terms, drain, plain_worth, draft_s, tpot_limit):
    """`_goodput_nodes`' curve in one compiled call: the candidates of trees laid end to end, valued on the
    recalibration's maps, ordered best first (`_order_candidates`), and every prefix of that order priced
    (`prefix_step_seconds`) and scored. Returns, in that order, each candidate's request, probs, value, index within
    its tree and rank within its request, then per prefix (k = 0..n) its expected worth, model seconds, corrected
    seconds and score. Called one by one, five kernels and the array operations between them cost each cap-1 CPU
    step up to 0.1 ms more: each Python-level call pays its dispatch on caches the verify has just left cold
    (goodput's allocation per MT-Bench cap-1 step, `throughput_avx2.json`'s time split: 0.342 ms at e31973d, 0.264
    ms at d1d812c)."""
    owner, parents = _batch_layout(sizes, local_parents)
    values = recalibrated_values(node_probs, node_depths, node_sources, parents, bucket_starts, knots_x, knots_y)
    owner, probs, value, index, rank, cumulative = _order_candidates(owner, sizes, values, factors, token_worth)
    model_s = prefix_step_seconds(rates, rows_table, n_layers, padded, coefficients, context, attention_calls,
                                  context[owner], rank)
    expected = plain_worth + cumulative
    step_s, score = _score_curve(model_s, expected, cost_terms, drain, draft_s, tpot_limit)
    return owner, probs, value, index, rank, expected, model_s, step_s, score


@nb.njit(cache=True)
def _chosen(keep, owner, probs, index, sizes):
    """The candidates at positions `keep` of `_goodput_curve`'s order, per request: how many, and the tokens they
    are expected to return (1 + their probs); and where they sit among the trees' nodes laid end to end, sorted."""
    b = sizes.shape[0]
    starts = np.zeros(b, np.int64)
    for r in range(1, b):
        starts[r] = starts[r - 1] + sizes[r - 1]
    nodes = np.zeros(b, np.int32)
    expected = np.zeros(b)
    kept = np.empty(keep.shape[0], np.int64)
    for j in range(keep.shape[0]):
        o = owner[keep[j]]
        nodes[o] += 1
        expected[o] += probs[keep[j]]
        kept[j] = starts[o] + index[keep[j]]
    return nodes, 1.0 + expected, np.sort(kept)
