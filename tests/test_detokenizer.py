"""Incremental detokenization with stop strings (`orchestrator.request.IncrementalDetokenizer`), on the default
model's real tokenizer: however a speculative step groups the tokens, the text and the tokens kept are what
plain decoding, one token at a time, gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from orchestrator.request import IncrementalDetokenizer
from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")

TEXTS = [
    "The cat sat on the mat. The cat sat on the mat.\n",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # 3\n",
    "Café, naïve, 日本語のテキスト, emoji 😀👍 and ünïcödé.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))


def decode_in_steps(tokenizer, ids: list[int], stops: tuple[str, ...], sizes: list[int]) -> tuple[str, int, bool]:
    """Feed `ids` in steps of `sizes` (cycled) as the orchestrator does: (text, tokens kept, stopped)."""
    detok = IncrementalDetokenizer(tokenizer, stops)
    text, kept, at, step = "", 0, 0, 0
    while at < len(ids):
        chunk = ids[at:at + sizes[step % len(sizes)]]
        delta, stopped_after = detok.add(chunk)
        text += delta
        if stopped_after is not None:
            return text, kept + stopped_after, True
        kept += len(chunk)
        at += len(chunk)
        step += 1
    return text + detok.flush(), kept, False


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(TEXTS) - 1), cuts=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 4)),
                                                          max_size=3),
       sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_any_grouping_of_the_tokens_keeps_what_one_at_a_time_keeps(tokenizer, which, cuts, sizes):
    text = TEXTS[which]
    ids = tokenizer.encode(text).ids
    # stop strings: pieces of the text (some of them span tokens), listed in any order
    stops = tuple(dict.fromkeys(text[int(f * (len(text) - 1)):][:n] for f, n in cuts))
    expected = decode_in_steps(tokenizer, ids, stops, [1])
    assert decode_in_steps(tokenizer, ids, stops, sizes) == expected
    full, kept, stopped = expected
    if stopped:  # plain decoding stopped at the first stop string its text completed, the text cut before it
        decoded = tokenizer.decode(ids[:kept])
        assert full == decoded[:min(decoded.find(s) for s in stops if s in decoded)]
    else:
        assert full == tokenizer.decode(ids) and kept == len(ids)
