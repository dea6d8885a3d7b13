"""Peer drafters used by the benchmarks: literal inputs with spelled-out expectations, and the REST rules on a real
datastore against a brute-force count trie."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from benchmarks.peers import AdedDrafter, PromptLookupDrafter, RestRulesDrafter, tree_from_rows
from datastore import Datastore, build_from_token_docs


def draft_once(drafter, context, budget):
    drafter.start_request("r", context)
    try:
        return drafter.draft([("r", budget)])[0]
    finally:
        drafter.stop_request("r")


def test_prompt_lookup_takes_the_longest_ngram_at_its_earliest_or_latest_occurrence():
    context = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3]
    # the 3-gram [1, 2, 3] occurs at 0 and 4: earliest -> [4, 1, 2, 3, 9]; latest -> [9, 1, 2, 3]
    assert draft_once(PromptLookupDrafter(), context, 5).tokens.tolist() == [4, 1, 2, 3, 9]
    assert draft_once(PromptLookupDrafter(most_recent=True), context, 5).tokens.tolist() == [9, 1, 2, 3]
    # k clips the draft; a draft is one chain
    tree = draft_once(PromptLookupDrafter(), context, 2)
    assert tree.tokens.tolist() == [4, 1] and tree.parents.tolist() == [-1, 0]
    # no earlier occurrence of any suffix n-gram -> empty
    assert len(draft_once(PromptLookupDrafter(), [5, 6, 7, 8], 4)) == 0
    # longer n-grams win over shorter ones: [7, 8] occurs once (-> 5); [8] alone occurs later (-> 6)
    assert draft_once(PromptLookupDrafter(), [7, 8, 5, 8, 6, 7, 8], 1).tokens.tolist() == [5]


def test_tree_from_rows_keeps_the_most_frequent_nodes():
    rows = np.array([[5, 6, 7], [5, 9, -1], [4, -1, -1], [5, 6, 8]], np.int32)
    tree = tree_from_rows(rows, 4, source=1)
    # counts: 5:3, 4:1, 5-6:2, 5-9:1, 5-6-7:1, 5-6-8:1 -> top 4 by count, shallower first on ties
    assert tree.tokens.tolist() == [5, 4, 6, 9]
    assert tree.parents.tolist() == [-1, -1, 0, 0]
    assert np.allclose(tree.probs, [0.75, 0.25, 0.5, 0.25])
    tree.validate()
    assert len(tree_from_rows(rows, 0, source=1)) == 0
    assert len(tree_from_rows(np.zeros((0, 3), np.int32), 5, source=1)) == 0


def test_rest_rules_use_the_longest_matching_suffix_only(tmp_path):
    docs = [np.array([1, 2, 3, 4, 5, 6]), np.array([9, 3, 4, 7, 7]), np.array([3, 4, 8]), np.array([2, 3, 4, 5, 0])]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=20))
    rest = RestRulesDrafter(ds, max_suffix=16, min_suffix=2, length=3)
    tree = draft_once(rest, [11, 2, 3, 4], 10)
    # [2, 3, 4] matches twice (docs 0 and 3) and is the longest: both continue with 5, then 6 / 0
    expected = Counter()
    for cont in ([5, 6], [5, 0]):
        for d in range(1, len(cont) + 1):
            expected[tuple(cont[:d])] += 1
    got = Counter()
    for i in range(len(tree)):
        got[tuple(tree.tokens[tree.path_to(i)].tolist())] = round(float(tree.probs[i]) * 2)
    assert got == expected
    assert len(draft_once(rest, [13, 14], 4)) == 0  # nothing matches


def test_aded_drafts_from_its_index(tmp_path):
    pytest.importorskip("draftretriever")
    docs = [[1, 2, 3, 4, 5, 6, 7]] * 3 + [[8, 9, 10]]
    index = tmp_path / "aded.idx"
    AdedDrafter.build_index(str(index), docs, vocab_size=50)
    tree = draft_once(AdedDrafter(str(index)), [1, 2, 3, 4], 4)
    tree.validate()
    assert 1 <= len(tree) <= 4 and tree.tokens[0] == 5
