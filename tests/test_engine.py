"""TorchEngine on the default model in fp32: losslessness, KV bookkeeping, sampling distribution, bad input.

One module-scoped engine (loading costs seconds); every test releases its own requests.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter.tree import DraftTree
from orchestrator.acceptance import accept
from orchestrator.spec_loop import generate
from trt_engines.base import KVCacheFullError, RequestError, SamplingParams, TargetEngine, VerifyItem
from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")

VOCAB = 49152
BLOCK = 16
NUM_BLOCKS = 56  # 896 tokens: less than max_context, so KV exhaustion is reachable
HYP = settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine():
    from trt_engines.torch_engine import TorchEngine

    torch.set_num_threads(2)
    # batch-invariant numerics (the bf16 default) with fp32's margin: the lossless tests below exercise the
    # depth-first slot layout with adversarial trees; the other test modules' fp32 engines run the fused kernel
    return TorchEngine("default", dtype=torch.float32, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_context=1024,
                       batch_invariant=True)


def _uid(prefix: str = "r") -> str:
    return f"{prefix}{next(_ids)}"


def _prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [1] + rng.integers(2, VOCAB, length - 1).tolist()


def _tree(rng: np.random.Generator, kind: str, truth: list[int]) -> DraftTree:
    """A draft tree of `kind` given the true greedy continuation `truth` from the root on (truth[0] follows it)."""
    if kind == "empty" or not truth:
        return DraftTree.empty()
    if kind == "perfect":
        return DraftTree.chain(truth[: rng.integers(1, 7)])
    if kind == "random":
        n = int(rng.integers(1, 12))
        parents = [int(rng.integers(-1, i)) for i in range(n)]
        return DraftTree.from_arrays(tokens=rng.integers(0, VOCAB, n), parents=parents)
    # adversarial: the true path hidden among decoys, a same-token decoy sibling ahead of it whose children are
    # wrong, wrong tokens below the true path, and a deep wrong branch.
    tokens, parents = [], []

    def add(tok: int, parent: int) -> int:
        tokens.append(int(tok))
        parents.append(parent)
        return len(tokens) - 1

    parent = -1
    for d, tok in enumerate(truth[: rng.integers(1, 5)]):
        add(rng.integers(0, VOCAB), parent)  # decoy sibling
        if d % 2 == 0:
            dup = add(tok, parent)  # same token as the truth, first among equals: acceptance takes this one
            add((tok + 1) % VOCAB, dup)
        parent = add(tok, parent)
    for _ in range(3):
        parent = add(rng.integers(0, VOCAB), parent)
    return DraftTree.from_arrays(tokens=tokens, parents=parents)


def _plain(engine, prompts, max_new):
    out, _ = generate(engine, prompts, max_new_tokens=max_new, id_prefix=_uid("plain"))
    return out


def test_satisfies_protocol(engine):
    assert isinstance(engine, TargetEngine)
    assert engine.vocab_size == VOCAB and engine.max_context == 1024 and engine.eos_token_ids == (2,)


def test_plain_greedy_equals_transformers_greedy(engine):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    prompt = _prompt(np.random.default_rng(5), 9)
    ours = _plain(engine, [prompt], 8)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert ours == ref[0, len(prompt) :].tolist()


@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    kinds=st.lists(st.sampled_from(["empty", "perfect", "random", "adversarial"]), min_size=1, max_size=4),
)
def test_speculative_greedy_equals_plain_greedy(engine, seed, kinds):
    rng = np.random.default_rng(seed)
    max_new = 8
    prompts = [_prompt(rng, int(rng.integers(1, 40))) for _ in kinds]
    plain = _plain(engine, prompts, max_new)
    prefix = _uid("spec")
    by_id = {f"{prefix}-{i}": (len(p), p + o, k) for i, (p, o, k) in enumerate(zip(prompts, plain, kinds))}

    def draft(rid, tokens):
        n_prompt, full, kind = by_id[rid]
        return _tree(rng, kind, full[len(tokens) :])

    spec, stats = generate(engine, prompts, max_new_tokens=max_new, draft_fn=draft, id_prefix=prefix)
    assert spec == plain
    for kind, s in zip(kinds, stats):
        if kind == "perfect":
            assert s.accepted > 0  # the perfect drafts really were accepted
    assert engine.free_blocks() == NUM_BLOCKS


@HYP
@given(seed=st.integers(0, 2**32 - 1), n_requests=st.integers(1, 3))
def test_kv_after_arbitrary_commits_equals_fresh_prefill(engine, seed, n_requests):
    rng = np.random.default_rng(seed)
    ids = [_uid("kv") for _ in range(n_requests)]
    cached: dict[str, list[int]] = {}
    roots: dict[str, int] = {}
    try:
        for rid in ids:
            prompt = _prompt(rng, int(rng.integers(1, 30)))
            roots[rid] = engine.add_request(rid, prompt, SamplingParams())
            cached[rid] = list(prompt)
        for _ in range(3):
            trees = {}
            for rid in ids:
                n = int(rng.integers(0, 10))
                trees[rid] = DraftTree.from_arrays(
                    tokens=rng.integers(0, VOCAB, n), parents=[int(rng.integers(-1, i)) for i in range(n)]
                )
            engine.verify([VerifyItem(rid, trees[rid]) for rid in ids])
            for rid in ids:  # commit an arbitrary root path (not what acceptance would pick) and any next root
                tree = trees[rid]
                path = [] if len(tree) == 0 or rng.random() < 0.3 else tree.path_to(int(rng.integers(0, len(tree)))).tolist()
                path = path[: int(rng.integers(0, len(path) + 1))]
                next_root = int(rng.integers(0, VOCAB))
                engine.commit(rid, path, next_root)
                cached[rid] += [roots[rid]] + tree.tokens[path].tolist()
                roots[rid] = next_root
        for rid in ids:
            fresh = _uid("fresh")
            engine.add_request(fresh, cached[rid], SamplingParams())
            try:
                got, want = engine.kv_snapshot(rid), engine.kv_snapshot(fresh)
            finally:
                engine.release(fresh)
            assert engine.context_length(rid) == len(cached[rid])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        for rid in ids:
            engine.release(rid)
    assert engine.free_blocks() == NUM_BLOCKS


def test_packed_paged_logits_match_transformers(engine):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    rng = np.random.default_rng(11)
    prompts = [_prompt(rng, n) for n in (3, 37, 20)]  # crosses block boundaries, different lengths in one forward
    ours = engine.debug_logits(prompts)
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            want = hf(torch.tensor([p])).logits[0]
            # fp32 rounding, relative to the logits' scale (~30): on an AVX-512 CPU transformers' own sdpa and eager
            # attention differ by up to 9e-5 here and ours by 1.3e-4; a wrong mask or position is off by whole units
            assert (want - got).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert engine.free_blocks() == NUM_BLOCKS


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """Brute-force target distribution: temperature, keep top_k (ties broken by value only)."""
    z = logits.double() / params.temperature
    kth = torch.sort(z, descending=True).values[params.top_k - 1]
    z = torch.where(z >= kth, z, torch.tensor(-np.inf, dtype=z.dtype))
    return torch.softmax(z, -1).numpy()


def test_sampled_first_token_has_target_distribution_and_is_the_same_with_and_without_speculation(engine):
    # The token sampled at a position depends on the request's seed and the target's distribution there alone
    # (`position_uniforms`): verified with a tree of likely drafts or without one, the root's sample is the same
    # token. Over requests of different seeds it follows the target distribution.
    rng = np.random.default_rng(3)
    prompt = _prompt(rng, 6)
    n_requests, rounds = 40, 3
    base = SamplingParams(temperature=1.0, top_k=4)
    expected, counts = np.zeros(VOCAB), np.zeros(VOCAB)
    for round_ in range(rounds):  # fresh seeds each round: independent draws
        ids = [_uid("samp") for _ in range(n_requests)]
        roots = {}
        try:
            for i, rid in enumerate(ids):
                roots[rid] = engine.add_request(rid, prompt, SamplingParams(temperature=1.0, top_k=4,
                                                                            seed=1000 + round_ * n_requests + i))
            distinct = sorted(set(roots.values()))
            target = dict(zip(distinct, (_filtered_probs(l[-1], base)
                                         for l in engine.debug_logits([prompt + [r] for r in distinct]))))
            expected += sum(target[roots[rid]] for rid in ids)
            sampled = {}
            for with_tree in (False, True):
                items = []
                for rid in ids:
                    top = np.argsort(-target[roots[rid]])[:3]  # speculate on likely tokens, plus a deeper node
                    tree = (DraftTree.from_arrays(tokens=[*top, 5], parents=[-1, -1, -1, 0]) if with_tree
                            else DraftTree.empty())
                    items.append(VerifyItem(rid, tree))
                sampled[with_tree] = [int(res.target_tokens[0]) for res in engine.verify(items).results]
            assert sampled[True] == sampled[False]
            for token in sampled[False]:
                counts[token] += 1
        finally:
            for rid in ids:
                engine.release(rid)
    support = np.nonzero(expected > 0)[0]
    assert counts[np.setdiff1d(np.arange(VOCAB), support)].sum() == 0, "sampled outside top_k"
    chi2 = (((counts[support] - expected[support]) ** 2) / expected[support]).sum()
    dof = len(support) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)).item()
    assert p_value > 1e-3, f"chi2 {chi2:.1f} on {dof} dof, p {p_value:.2g}"


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The naive top-p rule on one row (the sampler's before it searched with topk): sort the whole vocabulary
    descending, keep tokens while the mass before each is below top_p (at least one); every token as probable as
    the last one kept is kept too (ties at the edge)."""
    ordered = torch.sort(probs, descending=True).values
    before = ordered.cumsum(dim=-1) - ordered
    kept = max(int((before < top_p).sum()), 1)
    return probs >= ordered[kept - 1]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), top_p=st.floats(0.05, 0.999),
       shape=st.sampled_from(["peaked", "flat", "ties", "mixed"]), vocab=st.sampled_from([5000, 49152]))
def test_top_p_keeps_what_a_full_sort_keeps_in_any_batch(seed, rows, top_p, shape, vocab):
    # The nucleus is searched among each row's most probable tokens (the CPU kernel and torch.topk, each widening
    # where they hold too little mass) instead of sorting the vocabulary; both must keep exactly the naive rule's
    # tokens, each row alike whatever other rows share its batch (a tree's rows and plain decoding's one row sample
    # the same tokens).
    from trt_engines.sampling import _nucleus_by_topk, nucleus_threshold

    # (a flat row of SmolLM2's 49152 tokens holds its nucleus in thousands of tokens, whose prefix sums must be
    # rounded as PyTorch's cumsum rounds them)
    rng = np.random.default_rng(seed)
    scale = {"peaked": 3.0, "flat": 0.05, "ties": 1.0, "mixed": 1.0}[shape]
    logits = rng.standard_normal((rows, vocab)) * scale
    if shape == "ties":
        logits = np.round(logits)  # few distinct values: ties at the nucleus's edge
    if shape == "mixed":
        logits[::2] *= 6.0  # peaked rows beside flat ones
    probs = torch.from_numpy(logits.astype(np.float32)).softmax(dim=-1)
    threshold = nucleus_threshold(probs, top_p)
    assert torch.equal(_nucleus_by_topk(probs, top_p), threshold)
    for r in range(rows):
        assert torch.equal(probs[r] >= threshold[r], _nucleus_by_full_sort(probs[r], top_p))
        assert torch.equal(nucleus_threshold(probs[r : r + 1], top_p), threshold[r : r + 1])  # alone, the same


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), vocab=st.sampled_from([1, 7, 300, 5000]),
       zeros=st.floats(0.0, 0.99), floor_quantile=st.floats(0.0, 1.0))
def test_draw_inverts_the_kept_cdf_in_any_batch(seed, rows, vocab, zeros, floor_quantile):
    # The draw at uniform u is the first token whose cumulative kept mass (float64, vocabulary order) passes u times
    # the row's kept mass; kept: probability > 0 and at least the row's floor. The CPU kernel sums in blocks, the
    # PyTorch ops (CUDA's) over the whole vocabulary: both must pick the naive inversion's token, the first kept
    # token at u = 0 and the last one at u just under 1, a row alone as in any batch.
    from trt_engines.sampling import _draw_by_cumsum, draw_tokens

    rng = np.random.default_rng(seed)
    probs = rng.random((rows, vocab)).astype(np.float32) ** 4
    probs[rng.random((rows, vocab)) < zeros] = 0.0  # top-k and temperature leave zeros
    probs[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0  # at least one kept token a row
    floors = np.quantile(probs, floor_quantile, axis=-1, method="lower").astype(np.float32)
    uniforms = np.concatenate([[0.0, 1.0 - 2.0**-53], rng.random(rows)])[rng.permutation(rows + 2)[:rows]]
    kept = np.where((probs > 0) & (probs >= floors[:, None]), probs, 0.0).astype(np.float64)
    cdf = np.cumsum(kept, axis=-1)
    last_kept = vocab - 1 - np.argmax(kept[:, ::-1] > 0, axis=-1)
    expected = np.minimum([np.searchsorted(c, u * c[-1], side="right") for c, u in zip(cdf, uniforms)], last_kept)
    probs_t, floors_t = torch.from_numpy(probs), torch.from_numpy(floors)
    drawn = draw_tokens(probs_t, floors_t, uniforms).numpy()
    np.testing.assert_array_equal(drawn, expected)
    np.testing.assert_array_equal(_draw_by_cumsum(probs_t, floors_t, uniforms).numpy(), expected)
    assert (kept[np.arange(rows), drawn] > 0).all()
    for r in range(rows):  # alone, the same
        assert int(draw_tokens(probs_t[r : r + 1], floors_t[r : r + 1], uniforms[r : r + 1])[0]) == drawn[r]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kinds=st.lists(st.sampled_from(["greedy", "top_p", "top_k", "both", "plain"]),
                                                      min_size=1, max_size=6))
def test_a_step_samples_each_request_as_it_would_alone(seed, kinds):
    # `TorchEngine._sample` samples every request of a step in one call (`sample_requests`): each request's tokens
    # must be those it samples alone (a tree's rows and plain decoding's one row, in whatever batch), whatever the
    # others' temperatures, top_p and top_k; and the per-row top_p floors are each row's own, in the CPU kernel
    # as in CUDA's PyTorch ops.
    from trt_engines.sampling import _nucleus_by_topk, nucleus_threshold, sample_requests

    rng = np.random.default_rng(seed)
    vocab = 3000
    settings_of = {"greedy": {}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 20}, "both": {"top_k": 50, "top_p": 0.8},
                   "plain": {}}
    requests = [(SamplingParams(**({} if kind == "greedy" else {"temperature": float(rng.uniform(0.3, 1.5))}),
                                **settings_of[kind]), int(rng.integers(0, 2**40)),
                 np.sort(rng.integers(0, 4000, int(rng.integers(1, 5))))) for kind in kinds]
    rows = sum(len(positions) for _, _, positions in requests)
    logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8.0, (rows, 1)))
                              .astype(np.float32))
    together = sample_requests(logits, requests)
    alone = np.concatenate([sample_requests(part, [request]) for part, request in
                            zip(logits.split([len(p) for _, _, p in requests]), requests)])
    np.testing.assert_array_equal(together, alone)
    probs = logits.softmax(dim=-1)
    top_p = rng.choice([0.5, 0.9, 1.0], rows).astype(np.float32)
    per_row = nucleus_threshold(probs, top_p)
    assert torch.equal(_nucleus_by_topk(probs, top_p), per_row)
    for r in range(rows):
        assert torch.equal(nucleus_threshold(probs[r : r + 1], float(top_p[r])), per_row[r : r + 1])
    with pytest.raises(ValueError, match="own"):
        sample_requests(logits[1:], requests)


def test_sampling_a_row_of_nan_logits_is_token_zero_not_a_hang():
    # A broken model's NaN logits must not send the CPU kernels' widening search into a loop or an index out of range.
    from trt_engines.sampling import nucleus_threshold, sample_tokens

    logits = torch.zeros(3, 1000)
    logits[1] = float("nan")
    for top_p in (1.0, 0.9):
        tokens = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=1), 1, np.arange(3))
        assert int(tokens[1]) == 0
        assert 0 <= int(tokens[0]) < 1000 and 0 <= int(tokens[2]) < 1000
    # a NaN beside real probabilities that hold less than top_p: the widening stops at every real token
    assert nucleus_threshold(torch.tensor([[0.5, float("nan"), 0.2]]), 0.9).tolist() == [pytest.approx(0.2)]


def test_seeded_sampling_is_reproducible(engine):
    prompts = [_prompt(np.random.default_rng(4), 7)] * 2
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=7), SamplingParams(temperature=0.9, top_p=0.9, seed=8)]
    a, _ = generate(engine, prompts, max_new_tokens=6, sampling=params, stop_at_eos=False, id_prefix=_uid("s"))
    b, _ = generate(engine, prompts, max_new_tokens=6, sampling=params, stop_at_eos=False, id_prefix=_uid("s"))
    assert a == b


# ---- bad input: a clear error for that request; the others and the cache are untouched -------------------------


def test_logprobs_are_the_models_own_at_each_yielded_token_in_the_callers_node_order(engine):
    # `SamplingParams.logprobs`: the first token's from the prefill, and per token a verify yields (the root's
    # target, then each accepted node's, whatever slot order the engine laid the tree out in; no row for a rejected
    # node) the chosen token's log probability and the k most likely tokens', under log_softmax of the model's
    # logits; checked against those logits and against transformers' forward over the accepted text.
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    rng = np.random.default_rng(21)
    prompt, k = _prompt(rng, 30), 5
    truth = _plain(engine, [prompt], 8)[0]
    rid, plain_rid = _uid("lp"), _uid("lp")
    first = engine.add_request(rid, prompt, SamplingParams(logprobs=k))
    engine.add_request(plain_rid, prompt, SamplingParams())  # asks for none: gets none, beside one that does
    try:
        assert first == truth[0]
        first_lp = engine.first_token_logprobs(rid)
        assert engine.first_token_logprobs(rid) is None and engine.first_token_logprobs(plain_rid) is None
        assert first_lp.chosen.shape == (1,) and first_lp.top_ids.shape == first_lp.top_logprobs.shape == (1, k)
        # the true path t0, t1, t2 (nodes 1, 3, 5) among decoys, numbered breadth-first: the engine lays it out
        # depth-first (0, 2, 6, 1, 3, 5, 4) and must hand the rows back in this order
        decoy = lambda: int(rng.integers(0, VOCAB))  # noqa: E731
        tree = DraftTree.from_arrays(tokens=[decoy(), truth[1], decoy(), truth[2], decoy(), truth[3], decoy()],
                                     parents=[-1, -1, 0, 1, 1, 3, 2])
        assert not np.array_equal(tree.depth_first_order(), np.arange(len(tree)))
        out = {r.request_id: r for r in engine.verify([VerifyItem(rid, tree), VerifyItem(plain_rid, tree)],
                                                       return_logits=True).results}
        mine = out[rid]
        assert out[plain_rid].logprobs is None
        verdict = accept(tree, mine.target_tokens)
        assert verdict.accepted_nodes.tolist() == [1, 3, 5]
        path_rows = np.concatenate([[0], verdict.accepted_nodes + 1])
        rows = torch.log_softmax(mine.logits[torch.as_tensor(path_rows)], dim=-1)
        assert mine.logprobs.chosen.shape == (len(verdict.new_tokens),)
        target = torch.as_tensor(verdict.new_tokens, dtype=torch.int64)
        assert np.array_equal(mine.logprobs.chosen, rows.gather(1, target[:, None])[:, 0].numpy())
        top = torch.topk(rows, k, dim=-1)
        assert np.array_equal(mine.logprobs.top_ids, top.indices.numpy())
        assert np.array_equal(mine.logprobs.top_logprobs, top.values.numpy())
        text = prompt + [first] + tree.tokens[verdict.accepted_nodes].tolist()
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([text])).logits[0], dim=-1)[len(prompt) - 1:]
        got_chosen = np.concatenate([first_lp.chosen, mine.logprobs.chosen])
        chosen_tokens = [first] + verdict.new_tokens.tolist()
        want_chosen = want[torch.arange(len(chosen_tokens)), torch.tensor(chosen_tokens)].numpy()
        # fp32 rounding of logits ~30 in size (`test_packed_paged_logits_match_transformers`); a wrong row is off by
        # whole units
        np.testing.assert_allclose(got_chosen, want_chosen, atol=2e-3)
        got_top = np.concatenate([first_lp.top_logprobs, mine.logprobs.top_logprobs])
        np.testing.assert_allclose(got_top, torch.topk(want, k, dim=-1).values.numpy(), atol=2e-3)
    finally:
        engine.release(rid)
        engine.release(plain_rid)
    assert engine.free_blocks() == NUM_BLOCKS


@pytest.fixture
def bystander(engine):
    """A live request with one verify+commit behind it; yields a checker that it is intact and still decodes right."""
    rng = np.random.default_rng(21)
    prompt = _prompt(rng, 20)
    want = _plain(engine, [prompt], 6)[0]
    rid = _uid("by")
    root = engine.add_request(rid, prompt, SamplingParams())
    tree = DraftTree.chain(want[1:3])
    acc = accept(tree, engine.verify([VerifyItem(rid, tree)]).results[0].target_tokens)
    engine.commit(rid, acc.accepted_nodes, acc.bonus_token)
    produced = [root, *acc.new_tokens.tolist()]
    snapshot = engine.kv_snapshot(rid)
    free = engine.free_blocks()

    def check():
        assert engine.free_blocks() == free
        assert torch.equal(engine.kv_snapshot(rid), snapshot)
        out = engine.verify([VerifyItem(rid, DraftTree.empty())]).results[0].target_tokens
        assert produced + out.tolist() == want[: len(produced) + 1]

    yield rid, check
    engine.release(rid)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "empty prompt"),
        ([1, VOCAB], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([1.5, 2.0], "int token ids"),
        ([1] * 1024, "context limit is 1024"),
        ([1] * 1000, "KV blocks"),
    ],
    ids=["empty", "too-high", "negative", "floats", "too-long", "kv-full"],
)
def test_bad_prompts(engine, bystander, prompt, match):
    rid, check = bystander
    bad = _uid("bad")
    with pytest.raises(RequestError, match=match) as info:
        engine.add_request(bad, prompt, SamplingParams())
    assert bad in str(info.value) and bad not in engine.requests
    check()


def test_kv_exhaustion_is_a_kv_error(engine, bystander):
    with pytest.raises(KVCacheFullError):
        engine.add_request(_uid("big"), [1] * (engine.free_blocks() * BLOCK + 1), SamplingParams())
    bystander[1]()


def test_bad_requests_and_sampling(engine, bystander):
    rid, check = bystander
    with pytest.raises(RequestError, match="already active"):
        engine.add_request(rid, [1, 2], SamplingParams())
    with pytest.raises(RequestError, match="SamplingParams"):
        engine.add_request(_uid(), [1, 2], {"temperature": 1.0})
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(seed=-5),
                dict(logprobs=-1), dict(logprobs=21), dict(logprobs=True), dict(logprobs=2.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(RequestError, match="unknown request"):
        engine.release("never-added")
    check()


def _hand_tree(tokens, parents, depth) -> DraftTree:
    n = len(tokens)
    return DraftTree(
        tokens=np.asarray(tokens, np.int32), parents=np.asarray(parents, np.int32), probs=np.ones(n, np.float32),
        depth=np.asarray(depth, np.int32), source=np.zeros(n, np.int16),
    )


@pytest.mark.parametrize(
    "tree, match",
    [
        (DraftTree.chain([5, VOCAB + 3]), "token ids"),
        (_hand_tree([5, 6], [1, -1], [2, 1]), "parent"),  # child before parent
        (_hand_tree([5, 6], [1, 0], [2, 1]), "parent"),  # cycle
        (_hand_tree([5, 6], [-1, 7], [1, 2]), "parent"),  # parent out of range
        (DraftTree.chain([5] * 1100), "context limit"),
    ],
    ids=["token", "order", "cycle", "range", "too-big"],
)
def test_bad_trees_leave_the_batch_untouched(engine, bystander, tree, match):
    rid, check = bystander
    other = _uid("tree")
    engine.add_request(other, [1, 2, 3], SamplingParams())
    try:
        free = engine.free_blocks()
        with pytest.raises(RequestError, match=match) as info:
            engine.verify([VerifyItem(rid, DraftTree.empty()), VerifyItem(other, tree)])
        assert other in str(info.value)
        assert engine.free_blocks() == free
        with pytest.raises(RequestError, match="commit without"):  # the failed verify left nothing pending
            engine.commit(other, [], 5)
    finally:
        engine.release(other)
    check()


def test_bad_verify_batches_and_commits(engine, bystander):
    rid, check = bystander
    with pytest.raises(RequestError, match="twice"):
        engine.verify([VerifyItem(rid, DraftTree.empty()), VerifyItem(rid, DraftTree.empty())])
    with pytest.raises(RequestError, match="unknown"):
        engine.verify([VerifyItem(rid, DraftTree.empty()), VerifyItem("ghost", DraftTree.empty())])
    other = _uid("c")
    engine.add_request(other, [1, 2, 3, 4], SamplingParams())
    try:
        with pytest.raises(RequestError, match="without a preceding verify"):
            engine.commit(other, [], 3)
        tree = DraftTree.from_arrays(tokens=[7, 8, 9], parents=[-1, -1, 0])
        engine.verify([VerifyItem(other, tree)])
        snapshot, free = engine.kv_snapshot(other), engine.free_blocks()
        for path, root, match in [([1, 2], 3, "not a root path"), ([2], 3, "not a root path"), ([3], 3, "outside"),
                                  ([0], VOCAB, "vocabulary"), ([0], -1, "vocabulary"), ([], VOCAB, "vocabulary"),
                                  ([], 2.0, "int token ids"), ([], True, "int token ids")]:
            with pytest.raises(RequestError, match=match):
                engine.commit(other, path, root)
            assert torch.equal(engine.kv_snapshot(other), snapshot) and engine.free_blocks() == free
        engine.commit(other, [0, 2], 11)  # the failed commits left the verify pending
        assert engine.context_length(other) == 4 + 3
    finally:
        engine.release(other)
    check()


def test_verify_kv_exhaustion_names_the_request(engine, bystander):
    rid, check = bystander
    filler = _uid("fill")
    engine.add_synthetic_request(filler, (engine.free_blocks() - 1) * BLOCK)  # leaves one free block
    try:
        with pytest.raises(KVCacheFullError, match=filler):
            engine.verify([VerifyItem(rid, DraftTree.empty()), VerifyItem(filler, DraftTree.chain([3] * (2 * BLOCK)))])
    finally:
        engine.release(filler)
    check()


def test_can_admit_counts_blocks(engine):
    free = engine.free_blocks()
    assert engine.blocks_needed(0) == 0 and engine.blocks_needed(1) == 1 and engine.blocks_needed(BLOCK + 1) == 2
    assert engine.can_admit(free * BLOCK - 10, 10) and not engine.can_admit(free * BLOCK - 10, 11)
    assert not engine.can_admit(10, 10, tree_nodes=free * BLOCK)


def test_grouped_attention_answers_each_request_as_if_verified_alone(engine):
    # One deep tree among plain requests of different context lengths: the engine splits the batch into several SDPA
    # calls (`plan_attention_groups`); every request's target tokens must equal those of verifying it on its own.
    from trt_engines.attention_groups import plan_attention_groups

    rng = np.random.default_rng(11)
    prompts = [_prompt(rng, n) for n in (200, 7, 150, 12)]
    trees = [DraftTree.from_arrays(tokens=rng.integers(0, VOCAB, 24), parents=[-1] + [int(rng.integers(-1, i)) for i in range(23)]),
             DraftTree.empty(), DraftTree.chain(rng.integers(0, VOCAB, 2).tolist()), DraftTree.empty()]
    rows = np.array([len(t) + 1 for t in trees])
    assert len(plan_attention_groups(rows, rows + [len(p) for p in prompts])) > 1  # the batch really is split
    ids = [_uid("grp") for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p)
    try:
        together = engine.verify([VerifyItem(rid, t) for rid, t in zip(ids, trees)]).results
        for rid, tree, res in zip(ids, trees, together):
            alone = engine.verify([VerifyItem(rid, tree)]).results[0]
            assert res.request_id == rid and np.array_equal(res.target_tokens, alone.target_tokens)
    finally:
        for rid in ids:
            engine.release(rid)
    assert engine.free_blocks() == NUM_BLOCKS


@pytest.fixture(scope="module", params=["torch", "numba", "attention"])
def engine_bf16(request):
    from trt_engines.cpu_kernels import cpu_has_native_bf16
    from trt_engines.torch_engine import TorchEngine

    if request.param != "numba" and not cpu_has_native_bf16():
        pytest.skip("PyTorch's bf16 linear layers are batch-invariant only where the CPU has bf16 dot-product "
                    "instructions: on an AVX2 EPYC (Zen 3) these tests failed for 'torch' and 'attention' (logits "
                    "0.125-0.25 apart), at 767cd5d as at 1613baf; there 'auto' runs the numba kernels")
    return TorchEngine("default", dtype=torch.bfloat16, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_context=1024,
                       cpu_kernels=request.param)


def test_pytorch_bf16_kernels_warn_where_they_are_not_batch_invariant():
    # On CPUs without bf16 dot-product instructions PyTorch's bf16 linear layers part rows by batch (the fixture
    # above skips them there): asking for them with batch invariance warns; "numba" never does.
    import warnings

    from trt_engines.cpu_kernels import cpu_has_native_bf16
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
    model = Transformer.random(tiny, dtype=torch.bfloat16)
    for kernels in ("torch", "attention", "numba"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            TorchEngine(model, dtype=torch.bfloat16, num_blocks=8, cpu_kernels=kernels)
        warned = any("not batch-invariant" in str(w.message) for w in caught)
        assert warned == (kernels != "numba" and not cpu_has_native_bf16()), kernels


def test_auto_kernels_run_pytorchs_linear_layers_only_where_amx_backs_them():
    # "auto" is one choice per CPU (the two kinds of linear layer round differently, so never per step): PyTorch's
    # linear layers only with AMX-BF16, the numba kernels elsewhere, AVX512-BF16 without AMX included (there they
    # decoded a batch-1 step in 7.8 ms against PyTorch's 29.8; `cpu_kernels.auto_cpu_kernels`). fp32 engines never
    # take the bf16 kernels.
    from trt_engines.cpu_kernels import BF16_DOT_PRODUCTS, auto_cpu_kernels, cpu_description
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
    expected = "attention" if "amx_bf16" in flags else "numba"
    # results name the CPU's generation too: a cloud VM's "AMD EPYC" alone does not tell Zen 2 from Zen 4
    family = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("cpu family")), None)
    if family is not None:
        assert f"family {family} model " in cpu_description()
    assert auto_cpu_kernels() == expected
    assert ("AMX" in cpu_description()) == ("avx512_bf16" in flags or "amx_bf16" in flags)
    # the description names the linear layers "auto" runs (a run on an AMX Xeon once said numba's)
    assert ("PyTorch's linear layers" in cpu_description()) == (expected == "attention")
    assert ("numba linear layers" in cpu_description()) == (expected == "numba" and BF16_DOT_PRODUCTS)

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
    bf16 = TorchEngine(Transformer.random(tiny, dtype=torch.bfloat16), dtype=torch.bfloat16, num_blocks=8)
    assert bf16.cpu_kernels == expected
    assert bool(bf16.kernel_linears) == (expected == "numba")
    assert bf16.prefix_caching == (expected == "numba")  # exact reuse needs the kernels' prefill
    fp32 = TorchEngine(Transformer.random(tiny, dtype=torch.float32), dtype=torch.float32, num_blocks=8)
    assert fp32.cpu_kernels == "torch"


def test_torch_threads_default_to_one_on_a_gpu_unless_the_environment_or_the_caller_says():
    from trt_engines.torch_engine import host_torch_threads

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert host_torch_threads(cuda, None, environ={}) == 1
    assert host_torch_threads(cuda, None, environ={"OMP_NUM_THREADS": "4"}) is None  # the user's setting stays
    assert host_torch_threads(cpu, None, environ={}) is None  # the CPU forward runs on torch's threads
    assert host_torch_threads(cuda, 3, environ={"OMP_NUM_THREADS": "4"}) == 3
    assert host_torch_threads(cpu, 2, environ={}) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="torch_threads must be an int >= 1"):
            host_torch_threads(cpu, bad, environ={})


def test_the_engine_sets_torch_threads_it_is_given():
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
    model = Transformer.random(tiny, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="max_context"):  # a refused engine changes nothing
            TorchEngine(model, dtype=torch.float32, device="cpu", num_blocks=8, torch_threads=before + 1,
                        max_context=10**6)
        assert torch.get_num_threads() == before
        TorchEngine(model, dtype=torch.float32, device="cpu", num_blocks=8, torch_threads=1)
        assert torch.get_num_threads() == 1
        TorchEngine(model, dtype=torch.float32, device="cpu", num_blocks=8)  # None on the CPU: left as it is
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="torch_threads must be an int >= 1"):
            TorchEngine(model, dtype=torch.float32, device="cpu", num_blocks=8, torch_threads=0)
    finally:
        torch.set_num_threads(before)


def _decoy_tree(rng: np.random.Generator, max_nodes: int = 48) -> DraftTree:
    """Random tokens under random parents: up to `max_nodes`, so a batch often verifies more than 32 rows (where
    oneDNN's bf16 x W^T switches kernels: `llama.Linear.transposed`)."""
    n = int(rng.integers(1, max_nodes + 1))
    return DraftTree.from_arrays(tokens=rng.integers(0, VOCAB, n), parents=[int(rng.integers(-1, i)) for i in range(n)])


def _plain_bf16_logits(engine, rid, prompt, steps):
    """Plain decoding: the tokens, and the logits at each root (which predict the next token)."""
    first_root = engine.add_request(rid, prompt)
    tokens, logits = [], []
    try:
        for _ in range(steps):
            res = engine.verify([VerifyItem(rid, DraftTree.empty())], return_logits=True).results[0]
            logits.append(res.logits[0])
            tokens.append(int(res.target_tokens[0]))
            engine.commit(rid, [], next_root=tokens[-1])
    finally:
        engine.release(rid)
    return first_root, tokens, logits


def test_bf16_logits_do_not_depend_on_the_batch_or_the_tree(engine_bf16):
    # Batch invariance: a token's bf16 logits are bitwise those of plain decoding whether it is verified in a tree
    # (first-child chain, decoy branches after it) or next to requests of other contexts with trees of their own, so
    # speculative decoding in bf16 emits plain decoding's text. (Every CPU path: PyTorch's kernels in
    # batch-invariant numerics, the numba kernels, and the numba attention with PyTorch's linear layers.)
    engine = engine_bf16
    assert engine.batch_invariant  # the CPU default
    rng = np.random.default_rng(3)
    prompt, others = _prompt(rng, 150), [_prompt(rng, 40), _prompt(rng, 300)]
    steps = 24
    rid = _uid("inv")
    first_root = engine.add_request(rid, prompt)
    tokens, want = [], []  # want[k]: logits at the k-th root, which predict tokens[k]
    try:
        for _ in range(steps):
            res = engine.verify([VerifyItem(rid, DraftTree.empty())], return_logits=True).results[0]
            want.append(res.logits[0])
            tokens.append(int(res.target_tokens[0]))
            engine.commit(rid, [], next_root=tokens[-1])
    finally:
        engine.release(rid)
    assert engine.add_request(rid, prompt) == first_root
    other_ids = [_uid("inv") for _ in others]
    for oid, p in zip(other_ids, others):
        engine.add_request(oid, p)
    got = []
    try:
        while len(got) < steps:
            done = len(got)  # the root now is the one plain decoding had at step `done`
            path = tokens[done: done + min(int(rng.integers(0, 4)), steps - 1 - done)]
            n = len(path)  # the tree: this first-child chain, then decoy branches and a decoy below it
            decoys = int(rng.integers(1, 5))
            tree = DraftTree.from_arrays(
                tokens=path + rng.integers(0, VOCAB, decoys + 1).tolist(),
                parents=(list(range(-1, n - 1)) + [int(rng.integers(-1, n)) for _ in range(decoys)]
                         + [n - 1 if n else -1]))
            items = [VerifyItem(rid, tree)] + [VerifyItem(oid, _decoy_tree(rng)) if rng.random() < 0.5
                                               else VerifyItem(oid, DraftTree.empty()) for oid in other_ids]
            rng.shuffle(items)
            out = {r.request_id: r for r in engine.verify(items, return_logits=True).results}
            mine = out[rid]
            got += [mine.logits[0]] + [mine.logits[1 + i] for i in range(n)]
            assert mine.target_tokens[: n + 1].tolist() == tokens[done: done + n + 1]
            engine.commit(rid, list(range(n)), next_root=int(mine.target_tokens[n]))
            for oid in other_ids:
                engine.commit(oid, [], next_root=int(out[oid].target_tokens[0]))
        for position, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"position {position}: max |diff| {(g - w).abs().max().item()}"
    finally:
        for r in [rid] + other_ids:
            engine.release(r)
    assert engine.free_blocks() == NUM_BLOCKS


def test_bf16_kernel_logits_equal_plain_decoding_on_any_branch(engine_bf16):
    # With the numba kernels every row attends over exactly its visible keys, in order, so the accepted path may
    # leave the first-child chain (the true token is a later sibling, behind decoys with subtrees of their own)
    # and its logits are still bitwise plain decoding's: bf16 speculation is lossless on every branch.
    engine = engine_bf16
    if not engine.kernel_attention:
        pytest.skip("PyTorch's kernels are batch-invariant on first-child chains only (the test above)")
    rng = np.random.default_rng(11)
    prompt, other = _prompt(rng, 120), _prompt(rng, 200)
    steps = 20
    rid, oid = _uid("branch"), _uid("branch")
    first_root, tokens, want = _plain_bf16_logits(engine, rid, prompt, steps + 4)
    assert engine.add_request(rid, prompt) == first_root
    engine.add_request(oid, other)
    got, off_chain = [], 0
    try:
        while len(got) < steps:
            done = len(got)
            path = tokens[done: done + int(rng.integers(1, 4))]
            # each true token comes after a decoy sibling that has a decoy child: never a first child
            toks, parents, parent = [], [], -1
            for tok in path:
                toks += [int(rng.integers(0, VOCAB)), int(rng.integers(0, VOCAB)), tok]
                parents += [parent, len(toks) - 3, parent]
                parent = len(toks) - 1
            tree = DraftTree.from_arrays(tokens=toks, parents=parents)
            out = {r.request_id: r for r in engine.verify(
                [VerifyItem(oid, _decoy_tree(rng)), VerifyItem(rid, tree)], return_logits=True).results}
            mine = out[rid]
            accepted = [3 * k + 2 for k in range(len(path))]
            got += [mine.logits[0]] + [mine.logits[1 + node] for node in accepted]
            off_chain += len(path)
            assert [int(mine.target_tokens[i]) for i in [0] + [1 + node for node in accepted]] == \
                tokens[done: done + len(path) + 1]
            engine.commit(rid, accepted, next_root=int(mine.target_tokens[1 + accepted[-1]]))
            engine.commit(oid, [], next_root=int(out[oid].target_tokens[0]))
        for position, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"position {position}: max |diff| {(g - w).abs().max().item()}"
        assert off_chain >= steps // 2
    finally:
        for r in (rid, oid):
            engine.release(r)
    assert engine.free_blocks() == NUM_BLOCKS


def test_bf16_logprobs_on_any_branch_are_plain_decodings_bitwise(engine_bf16):
    # Log probabilities are log_softmax of logits that are bitwise plain decoding's on any branch (the test above),
    # row by row: speculation changes no logprob either, the first token's (from the prefill) included.
    engine = engine_bf16
    if not engine.kernel_attention:
        pytest.skip("PyTorch's kernels are batch-invariant on first-child chains only")
    rng = np.random.default_rng(12)
    prompt, steps, asked = _prompt(rng, 90), 10, SamplingParams(logprobs=3)
    rid = _uid("lpb")
    first = engine.add_request(rid, prompt, asked)
    want, tokens = [engine.first_token_logprobs(rid)], []
    try:
        for _ in range(steps + 4):
            res = engine.verify([VerifyItem(rid, DraftTree.empty())]).results[0]
            want.append(res.logprobs)
            tokens.append(int(res.target_tokens[0]))
            engine.commit(rid, [], next_root=tokens[-1])
    finally:
        engine.release(rid)
    assert engine.add_request(rid, prompt, asked) == first
    got, done = [engine.first_token_logprobs(rid)], 0
    try:
        while done < steps:
            path = tokens[done: done + int(rng.integers(1, 4))]
            toks, parents, parent = [], [], -1
            for tok in path:  # each true token after a decoy sibling with a decoy child: never a first child
                toks += [int(rng.integers(0, VOCAB)), int(rng.integers(0, VOCAB)), tok]
                parents += [parent, len(toks) - 3, parent]
                parent = len(toks) - 1
            tree = DraftTree.from_arrays(tokens=toks, parents=parents)
            res = engine.verify([VerifyItem(rid, tree)]).results[0]
            accepted = [3 * i + 2 for i in range(len(path))]
            assert accept(tree, res.target_tokens).accepted_nodes.tolist() == accepted
            got.append(res.logprobs)  # the rows of the root's target and each accepted node's
            engine.commit(rid, accepted, next_root=int(res.target_tokens[1 + accepted[-1]]))
            done += len(path) + 1
    finally:
        engine.release(rid)
    for name in ("chosen", "top_ids", "top_logprobs"):
        joined = np.concatenate([getattr(lp, name) for lp in got])
        assert np.array_equal(joined, np.concatenate([getattr(lp, name) for lp in want])[: len(joined)]), name
    assert engine.free_blocks() == NUM_BLOCKS


@given(st.integers(0, 2**32 - 1), st.integers(1, 9), st.sampled_from([2, 7, 49152]))
@settings(max_examples=40, deadline=None)
def test_greedy_tokens_pick_what_torchs_argmax_picks(seed, rows, vocab):
    """numpy's argmax stands in for torch's on the CPU (`greedy_tokens`): the same index on every row, ties (the
    first maximum), infinities and NaNs (a NaN counts as the maximum) included."""
    from trt_engines.sampling import greedy_tokens

    rng = np.random.default_rng(seed)
    logits = rng.choice(np.array([-np.inf, -1.0, 0.0, 0.5, 3.0, np.inf, np.nan], np.float32), (rows, vocab),
                        p=[0.05, 0.3, 0.3, 0.2, 0.1, 0.03, 0.02])
    logits[0] = rng.standard_normal(vocab)  # a row of distinct values beside the tie-heavy ones
    expected = torch.from_numpy(logits).argmax(dim=-1).numpy()
    picked = greedy_tokens(torch.from_numpy(logits))
    assert picked.dtype == np.int32
    np.testing.assert_array_equal(picked, expected)
    rows_view = torch.from_numpy(logits).split([1, rows - 1])[-1]  # a row group, as `_sample` passes
    np.testing.assert_array_equal(greedy_tokens(rows_view), expected[1:] if rows > 1 else expected[:0])
