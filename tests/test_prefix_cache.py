"""Prefix caching: `PagedKVCache`'s shared blocks (references, eviction, salts) on a tiny pool, and `TorchEngine`'s
reuse on the default model in bf16 with the CPU kernels, where a prompt read partly from the cache must decode
bitwise as if computed whole (and speculation over it must stay lossless)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import DraftTree
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator
from orchestrator.request import GenerationRequest
from orchestrator.roofline import HardwareSpec, ModelShape, StepTimeModel
from orchestrator.spec_loop import generate
from trt_engines.base import KVCacheFullError, RequestError, VerifyItem
from trt_engines.kv_cache import PagedKVCache
from trt_engines.prepare import default_model_dir, is_complete

BLOCK = 16


def _cache(num_blocks: int, *, prefix_caching: bool = True) -> PagedKVCache:
    return PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=4,
                        dtype=torch.float32, prefix_caching=prefix_caching)


def test_published_blocks_are_shared_by_reference_and_outlive_their_request():
    cache = _cache(8)
    tokens = np.arange(10)
    cache.ensure("a", 10)
    cache.publish("a", tokens, 10)  # blocks 0 and 1 are full; the third holds two tokens and is not published
    a = list(cache.tables["a"])
    assert cache.cached_blocks() == 2
    assert cache.match(np.r_[tokens[:8], 50, 51, 52], max_blocks=2) == a[:2]
    assert cache.match(np.r_[tokens[:4], 99, 5, 6, 7], max_blocks=2) == a[:1]  # the chain breaks at the first change
    assert cache.match(tokens, max_blocks=1) == a[:1]  # never more than asked for
    cache.attach("b", a[:2])
    cache.ensure("b", 11)
    assert cache.free_blocks() == 8 - 3 - 1  # b added one block of its own
    cache.release("a")
    assert cache.free_blocks() == 8 - 3  # a's unpublished block is free; the shared two are b's now
    assert cache.tables["b"][:2] == a[:2]
    cache.release("b")
    assert cache.free_blocks() == 8 and cache.cached_blocks() == 2  # cached, nobody holds them: free yet findable
    assert cache.match(tokens, max_blocks=2) == a[:2]
    with pytest.raises(RuntimeError, match="already holds"):
        cache.ensure("c", 1)
        cache.attach("c", a[:1])


def test_an_allocation_evicts_the_cached_block_released_longest_ago_a_tail_before_its_head():
    cache = _cache(4)
    first, second = np.arange(8), np.arange(100, 108)
    cache.ensure("a", 8)
    cache.publish("a", first, 8)
    cache.ensure("b", 8)
    cache.publish("b", second, 8)
    a, b = list(cache.tables["a"]), list(cache.tables["b"])
    cache.release("a")
    cache.release("b")
    assert cache.free_blocks() == 4
    cache.ensure("c", 4)  # nothing unused is left: a's tail goes first
    assert cache.match(first, 2) == a[:1] and cache.match(second, 2) == b
    cache.ensure("c", 8)  # then a's head
    assert cache.match(first, 2) == [] and cache.match(second, 2) == b
    # a matched block nobody holds is free until attached: attaching it takes it off the free count
    assert cache.free_after_attach(b) == cache.free_blocks() - 2
    cache.attach("d", b)
    assert cache.free_blocks() == 0
    with pytest.raises(RuntimeError, match="0 free blocks"):  # held blocks are never evicted
        cache.ensure("c", 16)
    assert cache.match(second, 2) == b and cache.tables["c"] == a[::-1]


def test_salts_keep_prefixes_apart_and_reset_forgets_them():
    cache = _cache(6)
    tokens = np.arange(8)
    cache.ensure("a", 8)
    cache.publish("a", tokens, 8, salt="tenant-1")
    assert cache.match(tokens, 2) == [] and cache.match(tokens, 2, salt="tenant-2") == []
    assert cache.match(tokens, 2, salt="tenant-1") == cache.tables["a"]
    assert cache.reset_prefix_cache() == 2
    assert cache.match(tokens, 2, salt="tenant-1") == []
    assert cache.free_blocks() == 4  # a still holds its blocks
    cache.release("a")
    assert cache.free_blocks() == 6 and cache.cached_blocks() == 0


def test_served_requests_count_their_cached_prompt_tokens_once_they_finish():
    from orchestrator.request import FinishReason, RequestOutput, RequestStats
    from orchestrator.serving.metrics import ServingMetrics

    metrics = ServingMetrics()
    metrics.observe_output(RequestOutput("a", [5], stats=RequestStats(cached_prompt_tokens=32)), frontend="http")
    metrics.observe_output(RequestOutput("a", [6], finish_reason=FinishReason.LENGTH,
                                         stats=RequestStats(cached_prompt_tokens=32)), frontend="http")
    metrics.observe_output(RequestOutput("b", [], finish_reason=FinishReason.CANCELLED, stats=RequestStats()),
                           frontend="triton")
    assert metrics.registry.get_sample_value("retrospec_cached_prompt_tokens_total") == 32
    with pytest.raises(ValueError, match="cache_salt"):
        GenerationRequest(prompt_ids=(1, 2), cache_salt="")


def test_without_prefix_caching_nothing_is_kept():
    cache = _cache(4, prefix_caching=False)
    cache.ensure("a", 8)
    cache.publish("a", np.arange(8), 8)
    assert cache.match(np.arange(8), 2) == [] and cache.cached_blocks() == 0
    cache.release("a")
    assert cache.free_blocks() == 4


# ---- TorchEngine on the default model ---------------------------------------------------------------------------

needs_model = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")


@pytest.fixture(scope="module")
def engine():
    from trt_engines.torch_engine import TorchEngine

    torch.set_num_threads(2)
    # prefix caching asked for explicitly: the default where the numba kernels run, asked for with PyTorch's linear
    # layers ("auto" on a CPU with AMX-BF16), exact on both
    return TorchEngine("default", dtype=torch.bfloat16, num_blocks=64, block_size=BLOCK, max_context=1024,
                       prefix_caching=True)


def _decode(engine, rid, steps: int, *, chain: list[int] | None = None):
    """Greedy tokens and the logits at each root for `steps` plain steps (after one speculative step along `chain`,
    when given), then the request's K/V."""
    tokens, logits = [], []
    if chain:
        res = engine.verify([VerifyItem(rid, DraftTree.chain(chain))]).results[0]
        accepted = 0
        while accepted < len(chain) and chain[accepted] == int(res.target_tokens[accepted]):
            accepted += 1
        tokens += [int(t) for t in res.target_tokens[: accepted + 1]]
        engine.commit(rid, list(range(accepted)), next_root=tokens[-1])
    for _ in range(steps):
        res = engine.verify([VerifyItem(rid, DraftTree.empty())], return_logits=True).results[0]
        logits.append(res.logits[0])
        tokens.append(int(res.target_tokens[0]))
        engine.commit(rid, [], next_root=tokens[-1])
    return tokens, logits, engine.kv_snapshot(rid)


def _assert_same_bits(got, want) -> None:
    """Two `_decode` results agree bitwise: the tokens, the logits at every root and the request's K/V."""
    assert got[0] == want[0]
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(got[1], want[1]))
    assert torch.equal(got[2].view(torch.int16), want[2].view(torch.int16))


@needs_model
def test_a_prompt_read_partly_from_the_cache_decodes_bitwise_as_computed_whole(engine):
    rng = np.random.default_rng(5)
    shared = [1] + rng.integers(2, 49152, 39).tolist()  # 40 tokens: two full blocks to share
    a, b = shared + rng.integers(2, 49152, 9).tolist(), shared + rng.integers(2, 49152, 13).tolist()
    engine.reset_prefix_cache()
    engine.add_request("a", a)
    assert engine.cached_prompt_tokens("a") == 0
    root_b = engine.add_request("b", b)  # while a still holds the shared blocks
    assert engine.cached_prompt_tokens("b") == 2 * BLOCK
    engine.release("a")  # b's shared blocks stay b's
    got = _decode(engine, "b", 10)
    engine.release("b")

    engine.reset_prefix_cache()
    assert engine.add_request("whole", b) == root_b and engine.cached_prompt_tokens("whole") == 0
    want = _decode(engine, "whole", 10)
    engine.release("whole")
    _assert_same_bits(got, want)
    assert engine.free_blocks() == 64


@needs_model
def test_a_next_turn_reuses_the_last_turns_output_blocks(engine):
    rng = np.random.default_rng(6)
    prompt = [1] + rng.integers(2, 49152, 20).tolist()
    engine.reset_prefix_cache()
    root = engine.add_request("turn1", prompt)
    tokens, _, _ = _decode(engine, "turn1", 30, chain=[7, 8, 9])  # a speculative step's commit too
    engine.release("turn1")
    turn2 = prompt + [root] + tokens[:-1] + rng.integers(2, 49152, 5).tolist()  # the last token was never cached
    first = engine.add_request("turn2", turn2)
    cached = engine.cached_prompt_tokens("turn2")
    assert cached == (len(prompt) + 1 + len(tokens) - 1) // BLOCK * BLOCK
    got = _decode(engine, "turn2", 6)
    engine.release("turn2")
    engine.reset_prefix_cache()
    assert engine.add_request("turn2-whole", turn2) == first
    want = _decode(engine, "turn2-whole", 6)
    engine.release("turn2-whole")
    assert got[0] == want[0] and torch.equal(got[2].view(torch.int16), want[2].view(torch.int16))


@needs_model
def test_bad_salts_and_full_caches_are_refused_and_change_nothing(engine):
    rng = np.random.default_rng(7)
    prompt = [1] + rng.integers(2, 49152, 47).tolist()
    engine.reset_prefix_cache()
    engine.add_request("p", prompt, cache_salt="x")
    engine.release("p")
    free, cached = engine.free_blocks(), engine.kv.cached_blocks()
    assert engine.add_request("other-salt", prompt, cache_salt="y") is not None
    assert engine.cached_prompt_tokens("other-salt") == 0
    engine.release("other-salt")
    with pytest.raises(RequestError, match="cache_salt must be a string"):
        engine.add_request("bad", prompt, cache_salt=5)
    engine.add_request("filler", [3] * (40 * BLOCK))  # holds 40 of the 64 blocks
    free = engine.free_blocks()
    # the prompt's head is cached (and free); its tail needs more blocks than the rest of the pool has
    with pytest.raises(KVCacheFullError, match="KV blocks"):
        engine.add_request("huge", prompt + [5] * (free * BLOCK), cache_salt="x")
    assert "bad" not in engine.requests and "huge" not in engine.requests
    assert engine.free_blocks() == free and engine.kv.cached_blocks() >= cached
    engine.release("filler")
    engine.add_request("again", prompt, cache_salt="x")
    assert engine.cached_prompt_tokens("again") == 2 * BLOCK
    engine.release("again")


@needs_model
def test_orchestrated_speculation_over_cached_prefixes_is_lossless_and_reported(engine):
    rng = np.random.default_rng(8)
    system = [1] + rng.integers(2, 49152, 35).tolist()
    prompts = [system + rng.integers(2, 49152, n).tolist() for n in (5, 12, 30, 3)]
    engine.reset_prefix_cache()
    reference, _ = generate(engine, prompts, max_new_tokens=16, stop_at_eos=False, id_prefix="ref")
    engine.reset_prefix_cache()
    shape = ModelShape.from_config(default_model_dir())
    cpu = HardwareSpec("test-cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10, overhead_s=5e-3)
    orchestrator = Orchestrator(engine, Drafter(DrafterConfig(sources="input"), vocab_size=engine.vocab_size),
                                BudgetController(BudgetPolicy.parse("fixed:4"), StepTimeModel(shape, cpu)),
                                max_running=2)
    outputs, stats = {}, {}

    def collect(out):
        outputs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            stats[out.request_id] = out.stats

    ids = [orchestrator.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=16, ignore_eos=True,
                                                 cache_salt="s" if i < 3 else "t"), collect)
           for i, p in enumerate(prompts)]
    orchestrator.run_until_idle()
    assert [outputs[i] for i in ids] == reference
    assert [stats[i].cached_prompt_tokens for i in ids] == [0, 2 * BLOCK, 2 * BLOCK, 0]  # the last has its own salt
    assert sum(sum(r.prefill_cached) for r in orchestrator.records) == 4 * BLOCK
    assert sum(s.accepted for s in stats.values()) > 0  # drafts were verified over the cached prefixes, and hit
    assert engine.free_blocks() == 64


@needs_model
def test_debug_logits_are_the_logits_the_engine_decodes_with(engine):
    # prefills and debug forwards share the verify step's invariant forward, so a divergence study (the throughput
    # benchmark's top-2 gap) reads the logits decoding used, bitwise
    rng = np.random.default_rng(9)
    prompt = [1] + rng.integers(2, 49152, 30).tolist()
    root = engine.add_request("dbg", prompt)
    step = engine.verify([VerifyItem("dbg", DraftTree.empty())], return_logits=True).results[0].logits[0]
    engine.release("dbg")
    debug = engine.debug_logits([prompt + [root]])[0]
    assert int(debug[-2].argmax()) == root
    assert torch.equal(debug[-1].view(torch.int32), step.view(torch.int32))
