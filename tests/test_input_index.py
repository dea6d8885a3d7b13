"""InputIndex: count-trie of prompt + self-output against a brute-force count over the token sequence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.input_index import InputIndex


def brute_matches(seq: list[int], q: int, depth: int) -> list[tuple[int, int, dict]]:
    """For m = q..1: earlier occurrences of the last m tokens and the counts of every continuation path."""
    n = len(seq)
    out = []
    for m in range(min(q, n), 0, -1):
        suffix = seq[n - m :]
        counts: dict[tuple[int, ...], int] = {}
        occ = 0
        for start in range(0, n - m):  # occurrences ending before the last position
            if seq[start : start + m] == suffix:
                occ += 1
                cont = seq[start + m : start + m + depth]
                for d in range(1, len(cont) + 1):
                    counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
        if occ:
            out.append((m, occ, counts))
    return out


def as_tuples(idx: InputIndex, rid) -> list[tuple[int, int, dict]]:
    return [(s.m, s.occurrences, s.counts) for s in idx.matches(rid)]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), max_size=30),
    chunks=st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=8),
    q=st.integers(1, 4),
    depth=st.integers(1, 5),
)
def test_matches_equal_brute_force_under_incremental_extension(prompt, chunks, q, depth):
    idx = InputIndex(query_len=q, depth=depth, vocab_size=5)
    idx.start_request("r", prompt)
    seq = list(prompt)
    assert as_tuples(idx, "r") == brute_matches(seq, q, depth)
    for chunk in chunks:
        idx.extend("r", chunk)
        seq += chunk
        assert idx.tokens("r").tolist() == seq
        assert as_tuples(idx, "r") == brute_matches(seq, q, depth)


@settings(max_examples=25, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=400), step=st.integers(1, 40))
def test_memory_cap_keeps_newest_window_and_stays_exact(tokens, step):
    cap = 4 * (2 + 3)  # smallest cap allowed for q=2, depth=3
    idx = InputIndex(query_len=2, depth=3, max_tokens=cap, vocab_size=4)
    idx.start_request(7, tokens[:step])
    for i in range(step, len(tokens), step):
        idx.extend(7, tokens[i : i + step])
    kept = idx.tokens(7).tolist()
    assert len(kept) <= cap
    assert kept == tokens[len(tokens) - len(kept) :]  # the newest tokens, contiguous
    assert idx.num_tokens(7) == len(tokens)
    assert idx.num_nodes(7) <= 1 + (2 + 3) * cap
    assert as_tuples(idx, 7) == brute_matches(kept, 2, 3)


def test_prompt_and_output_are_one_sequence():
    idx = InputIndex(query_len=2, depth=2, vocab_size=10)
    idx.start_request("r", [1, 2, 3])
    idx.extend("r", [1, 2])  # "1 2" first occurred across nothing; now it repeats across the boundary
    (m2, m1) = idx.matches("r")
    assert (m2.m, m2.occurrences, m2.counts) == (2, 1, {(3,): 1, (3, 1): 1})
    assert m1.m == 1 and m1.counts == {(3,): 1, (3, 1): 1}


def test_lifecycle_and_views():
    idx = InputIndex(vocab_size=100)
    idx.start_request("a", [1, 2, 3])
    idx.start_request("b", [])
    assert set(idx.active_requests) == {"a", "b"}
    view = idx.tokens("a")
    with pytest.raises(ValueError):
        view[0] = 5  # read-only view
    assert idx.matches("b") == []
    idx.stop_request("a")
    assert set(idx.active_requests) == {"b"}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda i: i.start_request("a", [1]), "already active"),
        (lambda i: i.extend("zzz", [1]), "unknown request id 'zzz'"),
        (lambda i: i.stop_request("zzz"), "unknown request id"),
        (lambda i: i.extend("a", [1, 100]), "token id 100 outside the vocabulary"),
        (lambda i: i.extend("a", [-1]), "token id -1 outside"),
        (lambda i: i.extend("a", [[1, 2]]), "1-D"),
        (lambda i: i.extend("a", [1.5]), "integer token ids"),
        (lambda i: i.start_request("new", [100]), "outside the vocabulary"),
    ],
)
def test_bad_input_raises_and_damages_nothing(call, match):
    idx = InputIndex(query_len=2, depth=2, vocab_size=100)
    idx.start_request("a", [1, 2, 3, 1, 2])
    before = (idx.tokens("a").tolist(), as_tuples(idx, "a"), set(idx.active_requests))
    with pytest.raises(ValueError, match=match):
        call(idx)
    assert (idx.tokens("a").tolist(), as_tuples(idx, "a"), set(idx.active_requests)) == before


def test_long_stream_grows_linearly():
    rng = np.random.default_rng(0)
    idx = InputIndex(vocab_size=50)
    idx.start_request("r", rng.integers(0, 50, 100))
    for _ in range(200):
        idx.extend("r", rng.integers(0, 50, 10))
    assert idx.num_tokens("r") == 2100
    assert idx.num_nodes("r") <= 1 + idx.window * 2100


def test_output_history_keeps_outputs_not_prompts_newest_whole_outputs_first():
    idx = InputIndex(query_len=2, depth=3, history_tokens=50)
    outputs = [list(range(100 * i, 100 * i + 20)) for i in range(1, 4)]
    for i, out in enumerate(outputs):
        idx.start_request(i, [7, 8, 9])
        idx.extend(i, out[:5])
        idx.extend(i, out[5:])
        idx.stop_request(i)
        kept = [o.tolist() for o in idx.history()]
        assert sum(map(len, kept)) <= 50
        assert kept == outputs[i + 1 - len(kept) : i + 1]  # the newest whole outputs, oldest first
    assert [o.tolist() for o in idx.history()] == outputs[2:]  # 60 tokens > 50: the oldest two were dropped
    idx.start_request("never-extended", [1, 2, 3])
    idx.stop_request("never-extended")  # no output: nothing remembered
    assert len(idx.history()) == 1
    idx.clear_history()
    assert idx.history() == []


def test_output_history_of_a_request_past_its_memory_cap_is_its_newest_output():
    idx = InputIndex(query_len=2, depth=2, max_tokens=64, history_tokens=1000)
    prompt, output = [900] * 10, list(range(1, 101))
    idx.start_request("r", prompt)
    for i in range(0, 100, 7):
        idx.extend("r", output[i : i + 7])
    idx.stop_request("r")
    (kept,) = idx.history()
    assert kept.tolist() == output[-len(kept):] and len(kept) >= 48  # no prompt token; the newest 3/4 cap or more


def test_output_history_off_and_bad_size():
    idx = InputIndex(query_len=2, depth=2)
    idx.start_request("r", [1, 2])
    idx.extend("r", [3, 4])
    idx.stop_request("r")
    assert idx.history() == [] and idx.history_slot == -1
    with pytest.raises(ValueError, match="history_tokens"):
        InputIndex(query_len=2, depth=2, history_tokens=-1)
