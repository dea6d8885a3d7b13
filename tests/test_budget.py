"""Budget controller and roofline step-time model: behaviour, not numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.tree import DraftTree
from orchestrator.budget import BudgetController, BudgetPolicy, prune_tree
from orchestrator.recalibration import OnlineRecalibration
from orchestrator.roofline import KNOWN_HARDWARE, HardwareSpec, ModelShape, StepTimeModel
from trt_engines.attention_groups import call_cost_for

LLAMA_8B = ModelShape.from_config({
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256,
})
SMOLLM2 = ModelShape.from_config({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                  "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152})


def chain_trees(batch: int, p: float, depth: int = 32) -> list[DraftTree]:
    """Chains whose path-acceptance probability decays geometrically: node d has prob p**d."""
    probs = p ** np.arange(1, depth + 1)
    return [DraftTree.chain(np.arange(depth) + 7 * i, probs=probs) for i in range(batch)]


def goodput_nodes(model: StepTimeModel, batch: int, p: float, context: int = 1024, tpot=None) -> np.ndarray:
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    _, decision = controller.allocate(chain_trees(batch, p), np.full(batch, context), tpot_s=tpot)
    return decision.nodes


def h100_model() -> StepTimeModel:
    return StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])


def test_policy_parsing_and_errors():
    assert BudgetPolicy.parse("fixed:16").fixed_nodes == 16
    assert str(BudgetPolicy.parse("goodput")) == "goodput"
    for bad in ("fixed", "fixed:0", "fixed:x", "greedy", "none:3"):
        with pytest.raises(ValueError, match="policy"):
            BudgetPolicy.parse(bad)


def test_more_running_requests_get_fewer_nodes_each():
    model = h100_model()
    per_request = [goodput_nodes(model, b, 0.8).mean() for b in (1, 16, 64, 256)]
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] > per_request[-1]


def test_a_large_batch_caps_each_request_and_a_lone_request_is_not_capped():
    # On an idle H100, near-certain chains would earn every request deep trees; in a batch of 128 the per-request
    # ceiling (the H100's free budget of ~295 tokens / 128, at least 4) bounds them, and every request gets as many.
    model = h100_model()
    batch = goodput_nodes(model, 128, 0.97)
    assert batch.max() == BudgetController(BudgetPolicy.parse("goodput"), model).node_ceiling(128) == 4
    assert (batch == 4).all()
    assert goodput_nodes(model, 1, 0.97)[0] > 16
    with pytest.raises(ValueError, match="batch_node_ceiling"):
        BudgetController(BudgetPolicy.parse("goodput"), model, batch_node_ceiling=0)


def test_higher_acceptance_gets_more_nodes():
    model = h100_model()
    nodes = [goodput_nodes(model, 32, p).sum() for p in (0.3, 0.6, 0.9)]
    assert nodes == sorted(nodes) and nodes[0] < nodes[-1]


def test_speculation_turns_off_when_extra_tokens_cost_a_full_step():
    # A device with no spare compute at all: each extra token costs as much as the whole step's weights.
    shape = ModelShape.from_config({"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
                                    "num_attention_heads": 8, "vocab_size": 1000})
    compute_starved = HardwareSpec("starved", {"bfloat16": 1e6}, mem_bandwidth=1e15)
    model = StepTimeModel(shape, compute_starved)
    assert goodput_nodes(model, 4, 0.9).sum() == 0
    # Same cost model via fitted coefficients: time = c * total tokens, no fixed part.
    model = h100_model()
    model.coefficients = np.array([0.0, 0.0, 0.0, 0.0, 1e-3, 0.0])
    assert goodput_nodes(model, 4, 0.95).sum() == 0


def test_tpot_objective_is_respected_by_the_prediction():
    model = h100_model()
    free = goodput_nodes(model, 8, 0.9)
    no_spec = model.predict(np.ones(8), np.full(8, 1024))
    tight = no_spec * 1.02
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    _, decision = controller.allocate(chain_trees(8, 0.9), np.full(8, 1024), tpot_s=np.full(8, tight))
    assert decision.predicted_step_s <= tight
    assert decision.nodes.sum() < free.sum()


def test_fixed_and_none_and_roofline_policies():
    model = h100_model()
    trees = chain_trees(4, 0.7)
    for text, expected in (("none", 0), ("fixed:5", 5)):
        pruned, decision = BudgetController(BudgetPolicy.parse(text), model).allocate(trees, np.full(4, 100))
        assert decision.nodes.tolist() == [expected] * 4 and [len(t) for t in pruned] == [expected] * 4
    roofline = BudgetController(BudgetPolicy.parse("roofline"), model)
    assert roofline.roofline_nodes(1) >= roofline.roofline_nodes(8) >= roofline.roofline_nodes(64) >= 0


def test_prune_keeps_the_most_probable_nodes_and_a_valid_tree():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)])
        raw = rng.random(n)
        probs = np.empty(n)
        for i in range(n):  # path probabilities never increase downwards
            probs[i] = raw[i] if parents[i] < 0 else probs[parents[i]] * raw[i]
        tree = DraftTree.from_arrays(tokens=rng.integers(0, 100, n), parents=parents, probs=probs)
        k = int(rng.integers(0, n + 1))
        pruned = prune_tree(tree, k)
        pruned.validate()
        assert len(pruned) == k
        assert np.isclose(np.sort(pruned.probs)[::-1], np.sort(tree.probs)[::-1][:k], rtol=1e-6).all()
        # the drafter's order (most probable first, ties included) takes the prefix path: the same nodes
        ordered = DraftTree.from_arrays(tokens=tree.tokens, parents=parents, probs=np.round(np.sort(raw)[::-1], 1))
        expected = ordered.subtree(np.sort(np.argsort(-ordered.probs, kind="stable")[:k]))
        got = prune_tree(ordered, k)
        got.validate()
        for field in ("tokens", "parents", "probs", "depth"):
            assert np.array_equal(getattr(got, field), getattr(expected, field))


def test_step_model_refit_recovers_a_linear_cost():
    shape = SMOLLM2
    model = StepTimeModel(shape, HardwareSpec("cpu", {"bfloat16": 3e11}, 3e10))
    rng = np.random.default_rng(1)
    truth = model.__class__(shape, model.hardware, coefficients=np.array([4e-3, 1.5, 3.0, 1.2, 2e-5, 0.0]))
    for _ in range(64):
        b = int(rng.integers(1, 16))
        tokens, context = rng.integers(1, 32, b), rng.integers(16, 2048, b)
        model.observe(tokens, context, truth.predict(tokens, context))
    tokens, context = np.array([8, 3]), np.array([700, 100])
    assert model.predict(tokens, context) == pytest.approx(truth.predict(tokens, context), rel=1e-3)


def staircase_rows(rows: int = 48, step_at: int = 16, cliff_s: float = 0.03, per_row_s: float = 5e-4) -> np.ndarray:
    """A row table shaped like oneDNN's AMX kernels on a Xeon (`benchmarks/results/verify_rows_amx_oneoff.md`):
    rows cost little up to `step_at`, then one more row costs `cliff_s` at once."""
    t = np.arange(1, rows + 1)
    return per_row_s * (t - 1) + np.where(t > step_at, cliff_s, 0.0)


def test_a_row_table_prices_its_steps_and_extends_at_its_slope():
    cpu = HardwareSpec("cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10)
    table = staircase_rows()
    model = StepTimeModel(SMOLLM2, cpu, coefficients=[0.01, 1.0, 0.0, 1.0, 1.0, 0.0], row_seconds=table)
    one = model.predict(np.ones(1), np.full(1, 64.0))
    assert one == pytest.approx(0.01)  # the table's one-row entry is 0; LM-head and token terms fold into it
    for rows in (2, 16, 17, 48):
        assert model.predict(np.array([float(rows)]), np.full(1, 64.0)) - one == pytest.approx(table[rows - 1])
    # rows are the step's total: four requests of 5 tokens cost the table's 20 rows (attention is priced apart)
    assert model.predict(np.full(4, 5.0), np.full(4, 64.0)) == pytest.approx(0.01 + table[19])
    # past the table: its last entry plus the slope of its upper half per row (here 0.5 ms)
    assert model.predict(np.array([58.0]), np.full(1, 64.0)) == pytest.approx(0.01 + table[-1] + 10 * 5e-4)
    # the clone prices alike; a table of one entry, or with a NaN, is refused
    assert model.clone().predict(np.array([17.0]), np.full(1, 64.0)) == model.predict(np.array([17.0]),
                                                                                      np.full(1, 64.0))
    for bad in ([0.0], [0.0, np.nan, 1e-3]):
        with pytest.raises(ValueError, match="row_seconds needs"):
            StepTimeModel(SMOLLM2, cpu, row_seconds=np.array(bad))


def test_goodput_stops_short_of_a_cliff_in_the_row_table_and_crosses_it_where_it_pays():
    # The roofline's rows are a line; a measured table has the GEMM library's steps. With a cliff after 16 rows
    # worth 3/4 of a step, a lone request of moderate acceptance stays within 16 rows, where the same table
    # without the cliff sends more nodes; drafts that nearly always land still cross it, as goodput says.
    cpu = HardwareSpec("cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10)
    coefficients = [0.04, 1.0, 0.0, 0.0, 0.0, 0.0]
    cliff = StepTimeModel(SMOLLM2, cpu, coefficients=coefficients, row_seconds=staircase_rows())
    smooth = StepTimeModel(SMOLLM2, cpu, coefficients=coefficients, row_seconds=staircase_rows(cliff_s=0.0))
    assert goodput_nodes(cliff, 1, 0.85, context=300)[0] <= 15
    assert goodput_nodes(smooth, 1, 0.85, context=300)[0] > 15
    assert goodput_nodes(cliff, 1, 0.995, context=300)[0] > 16


def test_a_refit_keeps_the_row_tables_steps():
    # Steps measured on a host running at 1.3x the table's speed: the fit scales the table, steps included.
    cpu = HardwareSpec("cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10)
    table = staircase_rows()
    truth = StepTimeModel(SMOLLM2, cpu, coefficients=[0.03, 1.3, 1.0, 0.0, 0.0, 0.0], row_seconds=table)
    model = StepTimeModel(SMOLLM2, cpu, row_seconds=table)
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(40):
        b = int(rng.integers(1, 5))
        tokens, context = rng.integers(1, 24, b).astype(float), rng.integers(16, 1024, b).astype(float)
        steps.append((tokens, context, truth.predict(tokens, context)))
    model.fit(steps)
    for rows in (16, 17):
        tokens, context = np.array([float(rows)]), np.array([300.0])
        assert model.predict(tokens, context) == pytest.approx(truth.predict(tokens, context), rel=1e-3)
    # switching the pricing drops the samples and sweep priced the other way
    model.set_row_seconds(None)
    assert model.samples() == [] and model.row_seconds is None
    assert model.predict(np.array([17.0]), np.array([300.0])) != pytest.approx(truth.predict(np.array([17.0]),
                                                                                             np.array([300.0])))


def test_step_model_fit_ignores_steps_slowed_by_background_load():
    # On a shared machine a burst of background load doubles a few steps; the typical step must stay predicted
    # right (a least-squares fit would move every prediction toward the slowed ones).
    shape = SMOLLM2
    hw = HardwareSpec("cpu", {"bfloat16": 1e11}, 3e10)
    truth = StepTimeModel(shape, hw, coefficients=np.array([0.03, 0.0, 3.0, 0.0, 1e-3]))
    rng = np.random.default_rng(7)
    steps = []
    for i in range(200):
        b = int(rng.integers(1, 16))
        tokens, context = rng.integers(1, 18, b).astype(float), rng.integers(16, 1024, b).astype(float)
        steps.append((tokens, context, truth.predict(tokens, context) * (2.0 if i % 10 == 0 else 1.0)))
    model = StepTimeModel(shape, hw)
    model.fit(steps)
    clean = [(t, c, m) for i, (t, c, m) in enumerate(steps) if i % 10]
    errors = [abs(model.predict(t, c) - m) / m for t, c, m in clean]
    assert np.median(errors) < 0.01


def test_step_model_learns_what_each_extra_attention_call_costs():
    # A grouped engine (TorchEngine) splits a step's attention into several calls; each costs host work that no
    # roofline term sees. Fitted on steps of a grouped engine, the model recovers that cost per call and layer.
    hw = HardwareSpec("cpu", {"bfloat16": 1e11}, 3e10)
    truth = StepTimeModel(SMOLLM2, hw, coefficients=np.array([0.03, 0.0, 3.0, 0.0, 1e-3, 1.4e-4]),
                          attention_layout="grouped")
    rng = np.random.default_rng(3)
    steps, calls = [], set()
    for _ in range(200):
        b = int(rng.integers(1, 17))
        tokens, context = rng.integers(1, 18, b).astype(float), rng.integers(16, 1024, b).astype(float)
        steps.append((tokens, context, truth.predict(tokens, context)))
        calls.add(truth.extra_attention_calls(tokens, context))
    assert len(calls) > 2  # the steps really are split into different numbers of calls
    model = StepTimeModel(SMOLLM2, hw, attention_layout="grouped")
    model.fit(steps)
    assert model.coefficients[5] == pytest.approx(1.4e-4, rel=0.02)
    # a packed engine (one call per layer) and a padded one never count extra calls
    for layout in ("packed", "padded"):
        other = StepTimeModel(SMOLLM2, hw, attention_layout=layout)
        assert all(other.extra_attention_calls(t, c) == 0.0 for t, c, _ in steps)


def test_step_coefficients_of_older_results_files_still_load():
    # results written before the attention-calls feature hold 5 coefficients: that feature gets 0
    old = StepTimeModel(SMOLLM2, HardwareSpec("cpu", {"bfloat16": 1e11}, 3e10),
                        coefficients=[0.03, 0.0, 3.0, 0.0, 1e-3], attention_layout="grouped")
    assert old.coefficients.tolist() == [0.03, 0.0, 3.0, 0.0, 1e-3, 0.0]
    with pytest.raises(ValueError, match="coefficients need 6 values"):
        StepTimeModel(SMOLLM2, HardwareSpec("cpu", {"bfloat16": 1e11}, 3e10), coefficients=[0.03, 1.0])


def test_free_budget_matches_the_ridge_formula():
    model = h100_model()
    hw = KNOWN_HARDWARE["H100-SXM"]
    assert model.free_budget() == pytest.approx(hw.peak_flops["bfloat16"] * 2 / (2 * hw.mem_bandwidth))
    with pytest.raises(ValueError, match="unknown hardware"):
        from orchestrator.roofline import hardware

        hardware("TPU-v9")


def test_realized_acceptance_below_prediction_shrinks_the_budget():
    model = h100_model()
    # without the per-request ceiling, which on an idle H100 would bind both before and after
    controller = BudgetController(BudgetPolicy.parse("goodput"), model, batch_node_ceiling=64 * 16)
    trees, context = chain_trees(16, 0.8), np.full(16, 1024)
    _, first = controller.allocate(trees, context)
    rng = np.random.default_rng(0)
    for _ in range(60):  # drafts are accepted at 30% of their calibrated rate
        _, decision = controller.allocate(trees, context)
        controller.observe(decision, accepted=rng.random(decision.node_probs.shape) < 0.3 * decision.node_probs,
                           draft_s=0.0, cap=32)
    sent, later = controller.allocate(trees, context)
    assert controller.acceptance_scale == pytest.approx(0.3, abs=0.05)
    assert 0 < later.nodes.sum() < first.nodes.sum()
    # predictions are the recalibrated values of the nodes sent
    values = [controller.recalibration.tree_values(t.probs, t.depth, t.parents).sum() for t in sent]
    assert later.predicted_tokens.sum() - 16 == pytest.approx(sum(values))
    with pytest.raises(ValueError, match="accepted has 3 entries"):
        controller.observe(later, accepted=np.ones(3), draft_s=0.0, cap=32)


def test_recalibration_corrects_each_probability_band_on_its_own():
    # Over-confident high-probability nodes (0.65 accepted 45% of the time) must not drag down well-calibrated
    # low-probability ones: those decide how many nodes are worth sending.
    recalibration = OnlineRecalibration()
    depth1 = lambda probs: recalibration(probs, np.ones(len(probs), np.int32))  # noqa: E731
    assert depth1(np.array([0.0, 0.15, 0.65, 1.0])) == pytest.approx([0.0, 0.15, 0.65, 1.0])  # no evidence
    rng = np.random.default_rng(0)
    for _ in range(200):
        probs = np.concatenate([np.full(20, 0.65), np.full(20, 0.15)])
        accepted = rng.random(40) < np.where(probs > 0.5, 0.45, 0.15)
        recalibration.observe(probs, np.ones(40, np.int32), accepted)
    high, low = depth1(np.array([0.65, 0.15]))
    assert high == pytest.approx(0.45, abs=0.05)
    assert low == pytest.approx(0.15, abs=0.03)
    grid = np.linspace(0, 1, 101)
    assert np.all(np.diff(depth1(grid)) >= 0) and depth1(grid).max() <= 1.0
    for _ in range(300):  # steps that verify nothing: back to trusting the calibration
        recalibration.observe(np.zeros(0), np.zeros(0, np.int32), np.zeros(0))
    assert depth1(np.array([0.65])) == pytest.approx([0.65], abs=0.01)
    with pytest.raises(ValueError, match="same shape"):
        recalibration.observe(np.ones(2), np.ones(2, np.int32), np.ones(3))
    # the lookups run in kernels without bounds checks: mismatched arrays and out-of-order parents are refused
    before = recalibration(grid, np.ones(grid.size, np.int32))
    with pytest.raises(ValueError, match="one length"):
        recalibration.observe(np.ones(2), np.ones(2, np.int32), np.ones(2), np.zeros(5, np.int16))
    with pytest.raises(ValueError, match="one length"):
        recalibration(np.ones(3), np.ones(2, np.int32))
    with pytest.raises(ValueError, match="one length"):
        recalibration.tree_values(np.ones(3), np.ones(3, np.int32), np.array([-1, 0]))
    with pytest.raises(ValueError, match="before it"):
        recalibration.tree_values(np.ones(3), np.ones(3, np.int32), np.array([-1, 2, 0]))
    assert np.array_equal(recalibration(grid, np.ones(grid.size, np.int32)), before)  # nothing observed or lost
    with pytest.raises(ValueError, match="decay"):
        OnlineRecalibration(decay=0.0)


def test_recalibration_discounts_deep_nodes_without_discounting_shallow_ones():
    # MT-Bench at cap 4: nodes calibrated near 0.4 were accepted 36% of the time at depth 1 and 24% at depths 5-7.
    recalibration = OnlineRecalibration()
    rng = np.random.default_rng(0)
    depths = np.repeat([1, 6], 20)
    for _ in range(200):
        probs = rng.uniform(0.25, 0.55, 40)
        recalibration.observe(probs, depths, rng.random(40) < np.where(depths == 1, probs, probs / 2))
    shallow, deep = recalibration(np.array([0.4, 0.4]), np.array([1, 6]))
    assert shallow == pytest.approx(0.4, abs=0.04)
    assert deep == pytest.approx(0.2, abs=0.04)
    # A controller that learned this sends a shallow sibling branch of lower calibrated probability before the
    # deep end of a chain, and the chosen nodes are still a tree.
    controller = BudgetController(BudgetPolicy.parse("goodput"), h100_model())
    controller.recalibration = recalibration
    tree = DraftTree.from_arrays(tokens=np.arange(8), parents=np.array([-1, 0, 1, 2, 3, 4, -1, 6]),
                                 probs=np.array([0.95, 0.9, 0.85, 0.8, 0.6, 0.45, 0.38, 0.35]))
    assert tree.depth[5] == 6 and tree.depth[7] == 2
    values = recalibration.tree_values(tree.probs, tree.depth, tree.parents)
    assert values[7] > values[5]
    pruned, decision = controller.allocate([tree], np.array([512.0]))
    assert decision.predicted_tokens[0] - 1 == pytest.approx(values[pruned[0].tokens].sum())
    kept = set(pruned[0].tokens.tolist())
    assert all(v <= min(values[sorted(kept)]) + 1e-12 for i, v in enumerate(values) if i not in kept)


def test_recalibration_lifts_retrieved_nodes_that_beat_their_calibration_and_only_them():
    # Chitchat at cap 4: datastore nodes calibrated at 0.14 were accepted 25% of the time while the request's own
    # index was on target. A goodput controller that cannot tell them apart starves the requests drafted from the
    # datastore.
    recalibration = OnlineRecalibration()
    rng = np.random.default_rng(1)
    sources = np.repeat([0, 1], 20)  # the request's own index, a datastore
    for _ in range(200):
        probs = rng.uniform(0.1, 0.2, 40)
        recalibration.observe(probs, np.ones(40, np.int32), rng.random(40) < np.where(sources == 0, probs, 2 * probs),
                              sources)
    own, retrieved = recalibration(np.array([0.15, 0.15]), np.array([1, 1]), np.array([0, 1]))
    assert own == pytest.approx(0.15, abs=0.03)
    assert retrieved == pytest.approx(0.30, abs=0.05)
    assert recalibration(np.array([0.15]), np.array([1])) == own  # no sources given: the request's own index
    # the controller passes every sent node's source back, so a fixed policy's steps teach the same map
    controller = BudgetController(BudgetPolicy.parse("goodput"), h100_model())
    tree = DraftTree.from_arrays(tokens=np.arange(2), parents=np.array([-1, -1]), probs=np.array([0.3, 0.2]),
                                 source=np.array([0, 2]))
    _, decision = controller.allocate([tree], np.array([512.0]))
    assert decision.nodes[0] == 2 and decision.node_sources.tolist() == [0, 2]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 12), st.booleans()), min_size=0, max_size=200),
       st.lists(st.tuples(st.integers(0, 1000), st.floats(0.0, 1.0)), min_size=2, max_size=40))
def test_recalibrated_trees_stay_trees(observations, nodes):
    # Whatever the recalibration has seen, each depth's map is non-decreasing and a node's value never exceeds its
    # parent's, so the goodput allocation's chosen nodes always include their ancestors.
    recalibration = OnlineRecalibration()
    for i, (p, depth, ok) in enumerate(observations):
        recalibration.observe(np.array([p]), np.array([depth]), np.array([float(ok)]), np.array([i % 3]))
    grid = np.linspace(0, 1, 101)
    for depth in range(1, 10):
        for source in (0, 1, 2):
            mapped = recalibration(grid, np.full(grid.size, depth), np.full(grid.size, source))
            assert np.all(np.diff(mapped) >= 0) and np.all((mapped >= 0) & (mapped <= 1))
    # a random tree: node i hangs under an earlier node (or the root); its probability is its parent's times a factor
    parents = np.array([-1] + [seed % (i + 1) - 1 for i, (seed, _) in enumerate(nodes[1:])])
    probs = np.empty(len(nodes))
    for i, (_, factor) in enumerate(nodes):
        probs[i] = factor * (probs[parents[i]] if parents[i] >= 0 else 1.0)
    tree = DraftTree.from_arrays(tokens=np.arange(len(nodes)), parents=parents, probs=probs)
    values = recalibration.tree_values(tree.probs, tree.depth, tree.parents)
    child = parents >= 0
    assert np.all(values[child] <= values[parents[child]])
    assert np.all(values <= recalibration(tree.probs, tree.depth))
    controller = BudgetController(BudgetPolicy.parse("goodput"), h100_model())
    controller.recalibration = recalibration
    pruned, decision = controller.allocate([tree], np.array([512.0]))  # subtree() checks the kept nodes' parents
    kept = pruned[0].tokens
    assert len(kept) == decision.nodes[0]
    assert decision.predicted_tokens[0] - 1 == pytest.approx(values[kept].sum())
    assert values[kept].min(initial=1.0) >= np.delete(values, kept).max(initial=0.0)  # the best nodes are kept


def test_recalibration_ratios_shrink_each_cell_toward_its_bin_and_bucket():
    # The documented shrinkage (`OnlineRecalibration.ratios`), written as array operations: each probability bin's
    # ratio over every bucket, each bucket's factor against what those ratios expect of it, and each cell shrunk
    # toward their product by its prior pseudo-nodes.
    recalibration = OnlineRecalibration()
    rng = np.random.default_rng(3)
    for _ in range(60):
        probs = rng.uniform(0, 1, 30)
        recalibration.observe(probs, rng.integers(1, 9, 30), rng.random(30) < probs ** 1.5, rng.integers(0, 3, 30))
    predicted, realized, prior = recalibration._predicted, recalibration._realized, recalibration._prior
    by_bin = (realized.sum(axis=0) + prior) / (predicted.sum(axis=0) + prior)
    bucket_factor = (realized.sum(axis=1) + 10.0) / (predicted @ by_bin + 10.0)
    expected = (realized + prior * by_bin * bucket_factor[:, None]) / (predicted + prior)
    np.testing.assert_allclose(recalibration.ratios, expected, rtol=1e-12)
    assert recalibration.ratios.shape == predicted.shape and np.all(recalibration.ratios > 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 1000), st.floats(0.05, 1.0), st.integers(0, 2)), min_size=0,
                         max_size=12), min_size=1, max_size=6),
       st.sampled_from(["packed", "grouped", "padded"]))
def test_a_goodput_decision_lists_exactly_the_nodes_it_sends(batch, layout):
    # The decision's per-node arrays (what `observe` learns from) are the sent trees' nodes, request by request in
    # tree order, whatever the allocation chose.
    trees = []
    for nodes in batch:
        parents = np.array([seed % (i + 1) - 1 for i, (seed, _, _) in enumerate(nodes)], np.int32)
        probs = np.empty(len(nodes))
        for i, (_, factor, _) in enumerate(nodes):
            probs[i] = factor * (probs[parents[i]] if parents[i] >= 0 else 1.0)
        trees.append(DraftTree.from_arrays(tokens=np.arange(len(nodes)), parents=parents, probs=probs,
                                           source=np.array([src for _, _, src in nodes], np.int16)))
    model = StepTimeModel(SMOLLM2, KNOWN_HARDWARE["H100-SXM"], attention_layout=layout)
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    pruned, decision = controller.allocate(trees, np.full(len(trees), 300.0))
    assert decision.nodes.tolist() == [len(t) for t in pruned]
    np.testing.assert_array_equal(decision.node_probs, np.concatenate([t.probs for t in pruned] + [[]]))
    np.testing.assert_array_equal(decision.node_depths, np.concatenate([t.depth for t in pruned] + [[]]))
    np.testing.assert_array_equal(decision.node_sources, np.concatenate([t.source for t in pruned] + [[]]))
    assert decision.node_probs.dtype == np.float64 and decision.node_sources.dtype == np.int16


def test_a_draining_offline_batch_speculates_for_its_slowest_request():
    # The batch is done when its slowest request is: nodes for a request that will finish long before it only make
    # the shared steps slower.
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    trees, context = chain_trees(8, 0.8), np.full(8, 1024)
    _, even = controller.allocate(trees, context)
    assert len(set(even.nodes.tolist())) == 1  # identical requests, identical trees: identical shares
    remaining = np.array([200.0, 10, 10, 10, 10, 10, 10, 10])
    _, draining = controller.allocate(trees, context, remaining_steps=remaining)
    assert draining.nodes[0] >= even.nodes[0] and np.all(draining.nodes[1:] < draining.nodes[0])
    # predictions stay the nodes' own expected acceptance, whatever weight chose them
    assert draining.predicted_tokens[0] - 1 == pytest.approx(trees[0].probs[:draining.nodes[0]].sum())
    # two requests about as far from done: either may finish last, so both are worth the tail's nodes
    _, pair = controller.allocate(trees, context, remaining_steps=np.array([200.0, 198, 10, 10, 10, 10, 10, 10]))
    assert min(pair.nodes[:2]) > max(pair.nodes[2:])
    # a request four times as fast takes a quarter of a step off per token: its deepest nodes no longer pay
    _, faster = controller.allocate(trees, context, remaining_steps=remaining,
                                    tokens_per_step=np.array([4.0, 1, 1, 1, 1, 1, 1, 1]))
    assert max(faster.nodes[1:]) < faster.nodes[0] < draining.nodes[0]
    # level requests share the tail: equal shares again, and every token saves a step's share, so it still pays
    _, level = controller.allocate(trees, context, remaining_steps=np.full(8, 50.0))
    assert len(set(level.nodes.tolist())) == 1 and level.nodes[0] > 0


def test_drafting_that_costs_more_than_it_returns_backs_off_and_probes_again():
    model = h100_model()
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    trees, context = chain_trees(8, 0.3), np.full(8, 1024)
    step_s = model.predict(np.ones(8), context)
    caps = []
    for _ in range(60):
        cap = controller.draft_cap(8)
        caps.append(cap)
        _, decision = controller.allocate(trees if cap else [DraftTree.empty()] * 8, context)
        # drafting costs half a step and the chains are weak: speculation cannot pay for it
        controller.observe(decision, accepted=decision.node_probs, draft_s=0.5 * step_s, cap=cap)
    assert all(c > 0 for c in caps[:8])  # the first steps measure the drafting cost (caches are cold at first)
    assert caps[8:].count(0) >= 40  # then drafting is mostly skipped ...
    assert any(c > 0 for c in caps[20:])  # ... with probes in between
    cheap = BudgetController(BudgetPolicy.parse("goodput"), model)
    for _ in range(60):
        cap = cheap.draft_cap(8)
        assert cap > 0  # cheap drafting of strong chains never backs off
        _, decision = cheap.allocate(chain_trees(8, 0.9), context)
        cheap.observe(decision, accepted=decision.node_probs, draft_s=1e-6, cap=cap)


def test_rare_drafts_that_pay_keep_drafting_on_when_drafting_is_cheap():
    # A lone request on a GPU whose drafter finds something only now and then (10, then 40 steps apart), but then a
    # strong chain, while drafting costs 0.4% of a step: drafting pays on average, so the back-off must not starve
    # the request of those chains. (Averaged over 5 drafted steps, the gain turned negative within a long gap and
    # the back-off's probes, one step each, kept missing the next chain.)
    hit_steps = set(np.cumsum(np.tile([10, 40], 12)).tolist())

    def hits_drafted(window: int) -> tuple[int, int]:
        model = h100_model()
        controller = BudgetController(BudgetPolicy.parse("goodput"), model, gain_window=window)
        context = np.full(1, 300)
        step_s = model.predict(np.ones(1), context)
        hits = drafted = 0
        for step in range(max(hit_steps) + 1):
            cap = controller.draft_cap(1)
            hit = step in hit_steps
            hits += hit
            drafted += hit and cap > 0
            trees = chain_trees(1, 0.9, depth=8) if hit and cap else [DraftTree.empty()]
            _, decision = controller.allocate(trees, context)
            controller.observe(decision, accepted=decision.node_probs, draft_s=0.004 * step_s, cap=cap)
        return hits, drafted

    hits, drafted = hits_drafted(32)
    assert drafted == hits
    assert hits_drafted(5)[1] < hits // 2  # the window decides it: a short one forgets the last chain too soon
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="gain_window"):
            BudgetController(BudgetPolicy.parse("goodput"), h100_model(), gain_window=bad)


@pytest.mark.parametrize("layout", ["packed", "grouped", "padded"])
def test_a_batch_with_nothing_drafted_gets_the_full_allocation_s_answer(layout):
    # Empty trees skip the allocation's machinery; the answer must be the one it gives when no candidate is worth
    # sending (here: nodes of probability 0): zero nodes, the plain step's prediction, and the same (negative) gain
    # once drafting has a measured cost, which is what backs drafting off.
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout=layout)
    context = np.array([300, 1024, 2048, 700])
    hopeless = [DraftTree.chain([5, 6, 7], probs=np.zeros(3)) for _ in range(4)]
    answers = []
    for trees in ([DraftTree.empty()] * 4, hopeless):
        controller = BudgetController(BudgetPolicy.parse("goodput"), model)
        _, warm = controller.allocate([DraftTree.empty()] * 4, context)
        controller.observe(warm, accepted=np.zeros(0), draft_s=0.004, cap=8, measured_s=warm.predicted_step_s)
        sent, decision = controller.allocate(trees, context, request_ids=["a", "b", "c", "d"])
        assert all(len(t) == 0 for t in sent) and decision.node_probs.size == 0
        answers.append(decision)
    empty, full = answers
    assert np.array_equal(empty.nodes, full.nodes) and np.array_equal(empty.predicted_tokens, full.predicted_tokens)
    assert empty.predicted_step_s == pytest.approx(full.predicted_step_s, rel=1e-12)
    assert empty.no_speculation_step_s == full.no_speculation_step_s and empty.request_ids == full.request_ids
    assert empty.gain == pytest.approx(full.gain, rel=1e-9) and empty.gain < 0


def test_speculated_tokens_that_cost_more_than_predicted_get_fewer_nodes():
    model = h100_model()
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    context = np.full(32, 1024)
    _, first = controller.allocate(chain_trees(32, 0.7), context)
    for p in np.tile([0.5, 0.6, 0.7, 0.8], 20):  # the device pays 6x the predicted cost of the speculated part
        _, d = controller.allocate(chain_trees(32, p), context)
        measured = d.no_speculation_step_s + 6.0 * (d.predicted_step_s - d.no_speculation_step_s)
        controller.observe(d, accepted=d.node_probs, draft_s=0.0, cap=64, measured_s=measured)
    _, later = controller.allocate(chain_trees(32, 0.7), context)
    assert controller.marginal_scale == pytest.approx(6.0, rel=0.05)
    assert controller.speculation_overhead == pytest.approx(0.0, abs=0.01)
    assert later.nodes.sum() < first.nodes.sum()


def test_a_fixed_cost_of_speculating_is_not_charged_to_every_node():
    # Measured: any speculating step costs 8% of a plain step more, then each node what the model predicts (the
    # CPU engine's tree masks and extra attention call). The controller learns the intercept and the slope apart.
    model = h100_model()
    context = np.full(4, 1024)
    rng = np.random.default_rng(0)
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    for _ in range(200):
        _, d = controller.allocate(chain_trees(4, float(rng.uniform(0.5, 0.95))), context)
        if d.nodes.sum():
            measured = 1.08 * d.no_speculation_step_s + (d.predicted_step_s - d.no_speculation_step_s)
        else:
            measured = d.no_speculation_step_s
        controller.observe(d, accepted=d.node_probs, draft_s=0.0, cap=64, measured_s=measured)
    assert controller.speculation_overhead == pytest.approx(0.08, abs=0.01)
    assert controller.marginal_scale == pytest.approx(1.0, abs=0.05)
    # the allocation pays the overhead once: it speculates, and deeper than a controller told nothing
    _, with_overhead = controller.allocate(chain_trees(4, 0.9), context)
    _, naive = BudgetController(BudgetPolicy.parse("goodput"), model).allocate(chain_trees(4, 0.9), context)
    assert with_overhead.nodes.sum() >= naive.nodes.sum() > 0


def sent_nodes_per_step(controller: BudgetController, model: StepTimeModel, slow_steps: range, steps: int) -> list[int]:
    """Nodes a controller sends per step on chains that barely pay, when the speculated part of the steps in
    `slow_steps` costs 30x its prediction (background load) and every other step takes what the model predicts."""
    context = np.full(16, 1024)
    sent = []
    for step in range(steps):
        cap = controller.draft_cap(16)
        _, d = controller.allocate(chain_trees(16, 0.15) if cap else [DraftTree.empty()] * 16, context)
        extra = d.predicted_step_s - d.no_speculation_step_s
        measured = d.no_speculation_step_s + (30.0 if step in slow_steps else 1.0) * extra
        controller.observe(d, accepted=d.node_probs, draft_s=0.005 * d.no_speculation_step_s, cap=cap,
                           measured_s=measured)
        sent.append(int(d.nodes.sum()))
    return sent


def test_speculation_stopped_by_a_burst_of_slow_steps_resumes_once_steps_are_fast_again():
    # Only speculating steps measure what speculation costs: a pessimistic estimate left by a burst must not stop
    # speculation for the rest of the run (HumanEval at cap 16 once decoded plainly on most steps after such a burst).
    model = h100_model()
    sent = sent_nodes_per_step(BudgetController(BudgetPolicy.parse("goodput"), model), model, range(20, 30), 300)
    assert all(n > 0 for n in sent[:20])
    assert sent[25:45].count(0) >= 10  # the burst stops speculation ...
    assert all(n > 0 for n in sent[150:])  # ... and it resumes
    # where speculation keeps costing that much, it stays mostly off: a probe now and then measures again
    saturated = sent_nodes_per_step(BudgetController(BudgetPolicy.parse("goodput"), model), model, range(20, 300), 300)
    assert 0 < sum(n > 0 for n in saturated[100:]) <= 20


def test_padded_attention_charges_every_request_for_the_deepest_tree():
    packed = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])
    padded = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout="padded")
    context = np.array([4096.0, 512.0, 512.0, 512.0])
    even, uneven = np.full(4, 5.0), np.array([1.0, 1.0, 1.0, 17.0])  # 20 tokens either way
    # same request shapes: the layouts agree; one deep tree: only the padded engine pays for it four times over
    assert padded.predict(even, np.full(4, 4096.0)) == pytest.approx(packed.predict(even, np.full(4, 4096.0)))
    assert padded.predict(uneven, context) > packed.predict(uneven, context)
    # 17 query rows (the deepest tree) over 4097 keys (the longest context + its root), for each of the 4 requests
    assert padded.batch_attention_seconds(uneven, context) == pytest.approx(
        4 * float(padded.attention_seconds(17.0, 4097.0 - 17.0)))
    # grouped: the deep tree gets its own call (17 rows over 513 keys), the rest one call at their own shape
    grouped = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout="grouped")
    assert packed.predict(uneven, context) <= grouped.predict(uneven, context) < padded.predict(uneven, context)
    with pytest.raises(ValueError, match="attention layout"):
        StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout="ragged")


def test_grouped_model_plans_calls_at_the_engines_price():
    # The model splits a step as the engine does: at a GPU engine's price of a call, a small tree beside plain
    # requests shares their call, so the model charges no extra call and pads the plain requests to its rows.
    context, tokens = np.full(16, 600.0), np.array([5.0] + [1.0] * 15)
    cpu = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout="grouped")
    gpu = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout="grouped",
                        attention_call_cost=call_cost_for("cuda"))
    assert cpu.extra_attention_calls(tokens, context) == LLAMA_8B.n_layers
    assert gpu.extra_attention_calls(tokens, context) == 0
    assert gpu.batch_attention_seconds(tokens, context) == pytest.approx(
        16 * float(gpu.attention_seconds(5.0, 600.0)))
    assert gpu.clone().attention_call_cost == call_cost_for("cuda")


@pytest.mark.parametrize("layout", ["packed", "grouped", "padded"])
@pytest.mark.parametrize("rows", [None, "table"])
def test_goodput_predicts_the_step_it_chooses(layout, rows):
    # The allocation's incremental step-time prediction equals the model's prediction of the chosen composition.
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout=layout,
                          row_seconds=None if rows is None else staircase_rows(cliff_s=2e-3, per_row_s=2e-5))
    controller = BudgetController(BudgetPolicy.parse("goodput"), model)
    rng = np.random.default_rng(0)
    for _ in range(20):
        batch = int(rng.integers(1, 9))
        trees = [DraftTree.chain(np.arange(16), probs=rng.uniform(0.5, 0.99) ** np.arange(1, 17)) for _ in range(batch)]
        context = rng.integers(64, 8192, batch).astype(float)
        _, decision = controller.allocate(trees, context)
        assert decision.predicted_step_s == pytest.approx(model.predict(1.0 + decision.nodes, context), rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["packed", "padded"]), st.lists(st.integers(0, 8000), min_size=1, max_size=12),
       st.lists(st.integers(0, 11), max_size=60), st.booleans())
def test_every_prefix_of_the_candidates_is_priced_as_its_own_step(layout, context, owners, table):
    # `prefix_seconds` prices all prefixes of the candidate order incrementally; each must be the step-time model's
    # prediction of that step composed from scratch (the grouped layout prices candidates packed while choosing),
    # with the roofline's row terms or a measured row table (up to 48 rows, then its slope: steps of up to 72 rows).
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], attention_layout=layout,
                          coefficients=[0.002, 0.9, 1.3, 1.1, 1e-6, 0.0],
                          row_seconds=staircase_rows(cliff_s=2e-3, per_row_s=2e-5) if table else None)
    context = np.array(context, dtype=np.float64)
    owner = np.array([o % context.size for o in owners], dtype=np.int64)
    rank = np.array([np.sum(owner[:i] == o) for i, o in enumerate(owner)], dtype=np.float64)
    prefix = model.prefix_seconds(context, context[owner], rank, 0.0)
    assert prefix.shape == (owner.size + 1,)
    for k in range(owner.size + 1):
        tokens = 1.0 + np.bincount(owner[:k], minlength=context.size)
        assert prefix[k] == pytest.approx(model.predict(tokens, context), rel=1e-12)


@pytest.mark.parametrize("shape, coefficients, batches, contexts", [
    # Llama-8B at long contexts, attention compute-bound (rows cost): batches above MAX_GROUPS share padded calls
    (LLAMA_8B, [0.002, 0.2, 20.0, 0.2, 0.0, 0.0], (5, 13), (1024, 8192)),
    # SmolLM2 on the CPU at batch 2-4: extra calls cost host work (~4 ms each), deeper trees pad the call they share
    (SMOLLM2, [0.03, 0.0, 3.0, 0.0, 1e-3, 1.4e-4], (2, 5), (200, 700)),
])
def test_on_a_grouped_engine_goodput_weighs_the_padding_and_calls_its_choice_costs(shape, coefficients, batches,
                                                                                    contexts):
    # A few deep trees among shallow ones pad the SDPA calls they share or split into calls of their own. Priced at
    # the engine's grouping, the choice is never worse than the greedy per-request (packed) pricing's, and differs.
    cpu = HardwareSpec("cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10)
    grouped = StepTimeModel(shape, cpu, coefficients=np.array(coefficients), attention_layout="grouped")
    packed = StepTimeModel(shape, cpu, coefficients=np.array(coefficients), attention_layout="packed")
    rng = np.random.default_rng(0)
    differed = 0
    for _ in range(20):
        batch = int(rng.integers(*batches))
        trees = [DraftTree.chain(np.arange(24), probs=rng.uniform(0.5, 0.97) ** np.arange(1, 25)) for _ in range(batch)]
        context = rng.integers(*contexts, batch).astype(float)
        _, chosen = BudgetController(BudgetPolicy.parse("goodput"), grouped).allocate(trees, context)
        _, greedy = BudgetController(BudgetPolicy.parse("goodput"), packed).allocate(trees, context)
        goodput = [d.predicted_tokens.sum() / grouped.predict(1.0 + d.nodes, context) for d in (chosen, greedy)]
        assert goodput[0] >= goodput[1] * (1 - 1e-9)
        assert chosen.predicted_step_s == pytest.approx(grouped.predict(1.0 + chosen.nodes, context), rel=1e-9)
        differed += not np.array_equal(chosen.nodes, greedy.nodes)
    assert differed > 0


def test_per_request_acceptance_favours_the_request_whose_drafts_land():
    model = h100_model()
    controller = BudgetController(BudgetPolicy.parse("goodput"), model, per_request_acceptance=True)
    trees, context, ids = chain_trees(2, 0.6), np.full(2, 1024), ["lands", "misses"]
    for _ in range(20):  # same calibrated trees; one request's drafts are always accepted, the other's never
        _, d = controller.allocate(trees, context, request_ids=ids)
        accepted = np.concatenate([np.ones(d.nodes[0]), np.zeros(d.nodes[1])])
        controller.observe(d, accepted=accepted, draft_s=0.0, cap=64)
    factors = controller.request_factors(ids, 2)
    assert factors[0] > 1.0 > factors[1]
    _, d = controller.allocate(trees, context, request_ids=ids)
    assert d.nodes[0] > d.nodes[1]
    assert controller.request_factors(["new"], 1)[0] == 1.0  # no history yet: the batch-wide recalibration alone


def test_online_refits_keep_the_start_up_sweep():
    # Under sustained load every step looks alike (plain decoding, one batch size): a refit on those alone cannot
    # tell the cost of extra tokens from the fixed cost. The start-up sweep stays in every refit.
    truth = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"], coefficients=np.array([0.002, 1.3, 1.1, 1.0, 0.0]))
    sweep = [(np.full(b, n + 1.0), np.full(b, float(c)), truth.predict(np.full(b, n + 1.0), np.full(b, float(c))))
             for b in (1, 4, 16) for n in (0, 3, 15, 31) for c in (128, 512)]
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])
    model.fit(sweep)
    twin = model.clone()
    assert np.allclose(twin.coefficients, model.coefficients) and twin.samples() == []
    for _ in range(64):  # plain steps only, all at batch 32 and context 1000
        twin.observe(np.ones(32), np.full(32, 1000.0), truth.predict(np.ones(32), np.full(32, 1000.0)))
    speculative = (np.full(32, 9.0), np.full(32, 1000.0))
    assert twin.predict(*speculative) == pytest.approx(truth.predict(*speculative), rel=0.02)


_FIRST_CONTROLLER = textwrap.dedent("""
    import json
    import numpy as np
    from numba.core.registry import CPUDispatcher
    from drafter.tree import DraftTree
    from orchestrator import budget, recalibration, roofline
    from orchestrator.budget import BudgetController, BudgetPolicy
    from orchestrator.roofline import KNOWN_HARDWARE, ModelShape, StepTimeModel

    kernels = {f"{m.__name__}.{name}": f for m in (budget, recalibration, roofline)
               for name, f in vars(m).items() if isinstance(f, CPUDispatcher)}
    compiled = lambda: {name: len(f.signatures) for name, f in kernels.items() if f.signatures}
    before = compiled()
    shape = ModelShape.from_config({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152})
    model = StepTimeModel(shape, KNOWN_HARDWARE["H100-SXM"])
    coefficients = model.coefficients.copy()
    controller = BudgetController(BudgetPolicy.parse("fixed:4"), model)
    built = compiled()
    untouched = {"policy": str(controller.policy), "samples": len(model.samples()),
                 "coefficients_kept": bool(np.array_equal(model.coefficients, coefficients)),
                 "recalibration_nodes": float(controller.recalibration._nodes.sum()),
                 "drafted_steps": controller._drafted_steps}
    # then goodput steps of a served batch: drafted trees, TPOT objectives, feedback, an offline batch's drain
    served = BudgetController(BudgetPolicy.parse("goodput"), model.clone())
    trees = [DraftTree.chain(np.arange(6) + 9 * i, probs=0.8 ** np.arange(1, 7)) for i in range(3)]
    context = np.array([40, 300, 900])
    for step in range(3):
        _, decision = served.allocate(trees, context, tpot_s=np.array([0.05, np.inf, 0.2]), request_ids=list("xyz"))
        accepted = (np.arange(decision.node_probs.size) % 2).astype(float)
        served.observe(decision, accepted=accepted, draft_s=2e-3, cap=16, measured_s=0.02)
    served.allocate(trees, context, request_ids=list("xyz"), remaining_steps=np.array([5.0, 50.0, 1.0]),
                    tokens_per_step=np.array([2.0, 1.5, 1.0]))
    print(json.dumps({"before": before, "built": built, "served": compiled(), **untouched}))
""")


def test_the_first_controller_of_a_process_compiles_the_goodput_steps_kernels_and_stays_untouched():
    # A goodput step runs numba functions (allocation, recalibration, step-time model) that compile on first use;
    # in a fresh install that cost the first goodput step of a process ~6 s. The first controller built in a
    # process compiles them on a throwaway controller (whatever its own policy), so that goodput steps afterwards
    # compile nothing more, and leaves the controller being built, and its step-time model, as they were.
    done = subprocess.run([sys.executable, "-c", _FIRST_CONTROLLER], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == {} and len(result["built"]) >= 4
    assert result["served"] == result["built"]  # the same functions, each with no new signature
    assert result["policy"] == "fixed:4" and result["samples"] == 0 and result["coefficients_kept"]
    assert result["recalibration_nodes"] == 0.0 and result["drafted_steps"] == 0
