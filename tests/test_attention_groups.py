"""How the engine splits a step's requests into SDPA calls: every request in exactly one call, never costlier than one
padded call, a batch of equal shapes stays one call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trt_engines.attention_groups import CALL_COST, CUDA_CALL_COST, ROW_OFFSET, call_cost_for, plan_attention_groups


def plan_cost(groups, rows, keys, call_cost=CALL_COST) -> float:
    return sum(len(g) * keys[g].max() * (rows[g].max() + ROW_OFFSET) + call_cost for g in groups)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 65), st.integers(1, 4096)), min_size=1, max_size=64),
       max_groups=st.integers(1, 6), call_cost=st.sampled_from([CALL_COST, CUDA_CALL_COST, 0.0]))
def test_plan_is_a_partition_no_costlier_than_one_call(shapes, max_groups, call_cost):
    rows, keys = np.array(shapes).T
    groups = plan_attention_groups(rows, keys, max_groups=max_groups, call_cost=call_cost)
    assert 1 <= len(groups) <= max_groups
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(shapes)))
    assert plan_cost(groups, rows, keys, call_cost) <= plan_cost([np.arange(len(shapes))], rows, keys, call_cost)


def test_a_dearer_call_splits_only_where_padding_costs_more():
    # On a GPU a call is a dozen host-launched kernels per layer: one small tree among plain requests, or plain
    # requests of spread contexts, stay one call there, though the CPU's price splits them.
    small_tree = (np.array([5] + [1] * 15), np.full(16, 600))
    spread = (np.ones(16, np.int64), np.linspace(150, 600, 16).astype(np.int64))
    for rows, keys in (small_tree, spread):
        assert len(plan_attention_groups(rows, keys, call_cost=call_cost_for("cpu"))) > 1
        assert len(plan_attention_groups(rows, keys, call_cost=call_cost_for("cuda"))) == 1
    # a 63-node tree beside 31 plain requests at 2k keys: padding every request to 64 rows costs more than a call
    deep = np.array([64] + [1] * 31), np.full(32, 2048)
    assert [g.tolist() for g in plan_attention_groups(*deep, call_cost=call_cost_for("cuda"))] == [
        [0], list(range(1, 32))]
    assert len(plan_attention_groups(*deep, call_cost=float("inf"))) == 1


def test_one_deep_tree_gets_its_own_call():
    rows, keys = np.array([1] * 31 + [61]), np.full(32, 600)
    groups = plan_attention_groups(rows, keys)
    assert [g.tolist() for g in groups] == [[31], list(range(31))]
    assert len(plan_attention_groups(np.full(32, 5), np.full(32, 600))) == 1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one length"):
        plan_attention_groups([1, 2], [3])
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="call_cost"):
            plan_attention_groups([1, 2], [3, 4], call_cost=bad)
