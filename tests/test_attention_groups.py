"""How the engine splits a step's requests into SDPA calls: every request in exactly one call, never costlier than one
padded call, a batch of equal shapes stays one call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trt_engines.attention_groups import CALL_COST, ROW_OFFSET, plan_attention_groups


def plan_cost(groups, rows, keys) -> float:
    return sum(len(g) * keys[g].max() * (rows[g].max() + ROW_OFFSET) + CALL_COST for g in groups)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 65), st.integers(1, 4096)), min_size=1, max_size=64),
       max_groups=st.integers(1, 6))
def test_plan_is_a_partition_no_costlier_than_one_call(shapes, max_groups):
    rows, keys = np.array(shapes).T
    groups = plan_attention_groups(rows, keys, max_groups=max_groups)
    assert 1 <= len(groups) <= max_groups
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(shapes)))
    assert plan_cost(groups, rows, keys) <= plan_cost([np.arange(len(shapes))], rows, keys)


def test_one_deep_tree_gets_its_own_call():
    rows, keys = np.array([1] * 31 + [61]), np.full(32, 600)
    groups = plan_attention_groups(rows, keys)
    assert [g.tolist() for g in groups] == [[31], list(range(31))]
    assert len(plan_attention_groups(np.full(32, 5), np.full(32, 600))) == 1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one length"):
        plan_attention_groups([1, 2], [3])
