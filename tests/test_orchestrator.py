"""The serving core end to end on the real default model (fp32), a real datastore and the real drafter.

Reference outputs come from `orchestrator.spec_loop.generate` without drafts: plain greedy decoding.
"""

from __future__ import annotations

import asyncio
import sysconfig
import threading
import time
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from datastore import Datastore, build_from_token_docs
from drafter.drafter import Drafter, DrafterConfig
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator
from orchestrator.request import FinishReason, GenerationRequest
from orchestrator.roofline import HardwareSpec, ModelShape, StepTimeModel
from orchestrator.runner import OrchestratorRunner
from orchestrator.spec_loop import generate
from trt_engines.base import SamplingParams
from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Hello! How are you today?",
    "for i in range(10):\n    for j in range(10):\n",
]
POLICIES = ("none", "fixed:4", "fixed:16", "roofline", "goodput")
CPU = HardwareSpec("test-cpu", {"float32": 1e11, "bfloat16": 3e11}, mem_bandwidth=2e10, overhead_s=5e-3)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine():
    from trt_engines.torch_engine import TorchEngine

    torch.set_num_threads(2)
    return TorchEngine("default", dtype=torch.float32, num_blocks=160, block_size=16, max_context=1024)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, tokenizer) -> Datastore:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("functools.py", "contextlib.py", "textwrap.py", "fnmatch.py")]
    docs = [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(texts)]
    out = tmp_path_factory.mktemp("ds") / "code"
    return Datastore.open(build_from_token_docs(docs, out, vocab_size=tokenizer.get_vocab_size(), tokenizer_id="test"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[tuple[int, ...]]:
    return [tuple(tokenizer.encode(p).ids) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engine, prompt_ids) -> list[list[int]]:
    outputs, _ = generate(engine, [list(p) for p in prompt_ids], max_new_tokens=24, id_prefix="ref")
    return outputs


def make_orchestrator(engine, datastore, policy: str, *, tokenizer=None, max_running=4, drafter=None,
                      draft_timeout_s=None, offline_batch=False, micro_batches=None, prefill_chunk=None):
    drafter = drafter or Drafter(DrafterConfig(), datastores=[datastore])
    model = StepTimeModel(ModelShape.from_config(default_model_dir()), CPU, dtype="float32")
    return Orchestrator(engine, drafter, BudgetController(BudgetPolicy.parse(policy), model),
                        tokenizer=tokenizer, max_running=max_running, draft_timeout_s=draft_timeout_s,
                        offline_batch=offline_batch, micro_batches=micro_batches, prefill_chunk=prefill_chunk)


def run_all(orchestrator, requests) -> dict[str, dict]:
    results: dict[str, dict] = {}

    def collect(out):
        r = results.setdefault(out.request_id, {"tokens": [], "text": "", "finish": None, "stats": None})
        r["tokens"] += out.token_ids
        r["text"] += out.text
        if out.finished:
            r["finish"], r["stats"], r["error"] = out.finish_reason, out.stats, out.error

    ids = [orchestrator.submit(req, collect, request_id=f"q{i}") for i, req in enumerate(requests)]
    orchestrator.run_until_idle(max_steps=2000)
    return {i: results[i] for i in ids}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_plain_greedy_output(engine, datastore, prompt_ids, reference, policy):
    orchestrator = make_orchestrator(engine, datastore, policy)
    free_before = engine.free_blocks()
    results = run_all(orchestrator, [GenerationRequest(prompt_ids=p, max_tokens=24) for p in prompt_ids])
    assert [r["tokens"] for r in results.values()] == reference
    assert engine.free_blocks() == free_before  # every request released its KV
    assert max(r.batch for r in orchestrator.records) > 1  # requests really were batched
    assert all(r.micro_batches == 1 for r in orchestrator.records)  # on the CPU every step verifies the whole batch
    accepted = sum(r["stats"].accepted for r in results.values())
    if policy != "none":
        assert accepted > 0  # speculation actually happened, so the equality above means something
    else:
        assert accepted == 0 and all(n == 0 for rec in orchestrator.records for n in rec.nodes)


def test_seeded_sampling_gives_plain_decodings_tokens_under_every_policy(engine, datastore, prompt_ids, reference):
    # The engine samples each position with a uniform of (seed, position): speculation returns the very tokens plain
    # sampling does, not only their distribution, and a seeded request gives the same tokens again after its
    # drafter has learnt from the first run (which changes its trees, and before, the draws the trees consumed).
    picked = [0, 2, 3]
    requests = [GenerationRequest(prompt_ids=prompt_ids[i], max_tokens=24, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i)) for i in picked]
    outputs, accepted = {}, 0
    for policy, runs in (("none", 1), ("fixed:16", 1), ("goodput", 2)):  # goodput's second run drafts from the first's
        orchestrator = make_orchestrator(engine, datastore, policy)
        for run in range(runs):
            results = run_all(orchestrator, requests)
            outputs[policy, run] = [r["tokens"] for r in results.values()]
            accepted += sum(r["stats"].accepted for r in results.values()) if policy != "none" else 0
    assert accepted > 0  # speculation happened, so equal outputs mean something
    assert outputs["fixed:16", 0] == outputs["goodput", 0] == outputs["goodput", 1] == outputs["none", 0]
    assert outputs["none", 0] != [reference[i] for i in picked]  # these really were sampled, not greedy


def test_logprobs_come_one_per_token_cut_with_them_and_speculation_changes_none(engine, datastore, prompt_ids,
                                                                                   reference, tokenizer):
    # Every update of a request that asks carries one log probability per token it streams, cut where its tokens are
    # (max_tokens in the middle of a speculative step, a stop string); a request that does not ask gets None.
    text = tokenizer.decode(reference[3])
    stop = tokenizer.decode([reference[3][6]]).strip()
    assert stop and stop in text
    kept = next(k for k in range(1, 25) if stop in tokenizer.decode(reference[3][:k]))
    asked = SamplingParams(logprobs=2)
    requests = [GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=24, sampling=asked),
                GenerationRequest(prompt_ids=prompt_ids[1], max_tokens=7, sampling=asked),
                GenerationRequest(prompt_ids=prompt_ids[3], max_tokens=24, sampling=asked, stop_strings=(stop,)),
                GenerationRequest(prompt_ids=prompt_ids[2], max_tokens=24)]
    expected = [reference[0], reference[1][:7], reference[3][:kept], reference[2]]
    runs = {}
    # the last: prompts prefilled in chunks (the first token's log probabilities come from the last chunk)
    for label, policy, options in (("none", "none", {}), ("fixed:16", "fixed:16", {}), ("goodput", "goodput", {}),
                                   ("chunked", "goodput", {"prefill_chunk": 7})):
        orchestrator = make_orchestrator(engine, datastore, policy, tokenizer=tokenizer, **options)
        updates: dict[str, list] = {}
        for i, request in enumerate(requests):
            orchestrator.submit(request, lambda out: updates.setdefault(out.request_id, []).append(out),
                                request_id=f"lp{i}")
        orchestrator.run_until_idle(max_steps=500)
        assert [[t for u in updates[f"lp{i}"] for t in u.token_ids] for i in range(4)] == expected
        for i in range(3):
            for update in updates[f"lp{i}"]:
                assert [e.token_id for e in update.logprobs] == update.token_ids
        assert all(u.logprobs is None for u in updates["lp3"])
        entries = [[e for u in updates[f"lp{i}"] for e in u.logprobs] for i in range(3)]
        for entry in (e for request in entries for e in request):  # greedy: the chosen token is the most likely
            assert len(entry.top) == 2 and entry.top[0] == (entry.token_id, entry.logprob) and entry.logprob <= 0
        if policy != "none":
            assert sum(r.realized_tokens - r.batch for r in orchestrator.records if r.batch) > 0  # it speculated
        if options:
            assert sum(len(r.prefill_tokens) for r in orchestrator.records) > len(requests)  # several chunks each
        runs[label] = entries
    for label in ("fixed:16", "goodput", "chunked"):  # fp32 verification of other row counts: the same up to rounding
        for got, want in zip(runs[label], runs["none"]):
            assert [e.token_id for e in got] == [e.token_id for e in want]
            np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4)
            np.testing.assert_allclose([[lp for _, lp in e.top] for e in got], [[lp for _, lp in e.top] for e in want],
                                       atol=1e-4)


def test_an_offline_batch_drains_losslessly(engine, datastore, prompt_ids, reference):
    # Requests of different lengths: once the queue is empty the drain values the slowest request's tokens most,
    # which changes who gets nodes, never what is generated.
    orchestrator = make_orchestrator(engine, datastore, "goodput", max_running=3, offline_batch=True)
    free_before = engine.free_blocks()
    lengths = [24 if i % 2 else 9 for i in range(len(prompt_ids))]
    requests = [GenerationRequest(prompt_ids=p, max_tokens=n) for p, n in zip(prompt_ids, lengths)]
    results = run_all(orchestrator, requests)
    assert [r["tokens"] for r in results.values()] == [ref[:n] for ref, n in zip(reference, lengths)]
    assert engine.free_blocks() == free_before
    assert sum(r["stats"].accepted for r in results.values()) > 0


def test_the_throughput_benchmark_keeps_its_policies_side_by_side_to_the_end(engine, datastore, prompt_ids,
                                                                              reference):
    # `benchmarks/throughput.py` steps whichever policy is furthest behind in its own work, so a policy that needs
    # far fewer steps still finishes with the others and none runs long alone (in turns, `none` here would take
    # the last third or more of its steps by itself, where a burst of background load would slow it alone).
    from benchmarks.throughput import serve_side_by_side

    model = StepTimeModel(ModelShape.from_config(default_model_dir()), CPU, dtype="float32")
    picked = [3, 4]  # the two prompts the datastore drafts well: fixed:4 needs about half of none's steps
    results = serve_side_by_side(engine, Drafter(DrafterConfig(), datastores=[datastore]), model,
                                 ["none", "fixed:4"], [np.asarray(prompt_ids[i]) for i in picked], cap=1,
                                 max_tokens=24, lengths=[24, 24])
    assert results["none"]["outputs"] == results["fixed:4"]["outputs"] == [reference[i] for i in picked]
    assert results["fixed:4"]["steps"] < 0.67 * results["none"]["steps"]
    # Either ran alone at most for the share of its work that the other's last step covered (5 of 48 tokens here)
    assert results["none"]["shared_steps_fraction"] >= 0.9
    assert results["fixed:4"]["shared_steps_fraction"] >= 0.9


def test_the_throughput_benchmark_samples_each_request_with_its_own_seed_under_every_policy(engine, datastore,
                                                                                          prompt_ids, reference):
    # `--temperature`: request i of a row is seeded SEED_BASE + i for every policy, so speculating policies return
    # `none`'s sampled tokens (the benchmark's losslessness check under sampling), and two requests of one row draw
    # with different seeds.
    from benchmarks.throughput import serve_side_by_side

    model = StepTimeModel(ModelShape.from_config(default_model_dir()), CPU, dtype="float32")
    picked = [3, 3, 4]  # one prompt twice: its two requests must sample apart
    results = serve_side_by_side(engine, Drafter(DrafterConfig(), datastores=[datastore]), model,
                                 ["none", "fixed:4"], [np.asarray(prompt_ids[i]) for i in picked], cap=2,
                                 max_tokens=24, lengths=[24] * 3,
                                 sampling=SamplingParams(temperature=0.8, top_p=0.95))
    sampled = results["none"]["outputs"]
    assert results["fixed:4"]["outputs"] == sampled
    assert sampled[0] != sampled[1] and sampled != [reference[i] for i in picked]
    assert results["fixed:4"]["steps"] < results["none"]["steps"]  # it did speculate, and some drafts held


def test_the_throughput_benchmark_takes_turns_while_its_policies_prefill_in_chunks(engine, datastore, prompt_ids):
    # Before any token every policy's progress is 0: the tie goes to the one with fewer steps, so the steps that
    # prefill a group's first prompts alternate instead of one policy prefilling all of its own first.
    from benchmarks.throughput import PolicyRun, interleave

    model = StepTimeModel(ModelShape.from_config(default_model_dir()), CPU, dtype="float32")
    drafter = Drafter(DrafterConfig(), datastores=[datastore])
    prompts = [np.asarray(prompt_ids[i]) for i in (0, 1)]
    chunk = 4
    assert min(len(p) for p in prompts) > 3 * chunk  # three steps or more before each policy's first token
    runs = [PolicyRun(engine, drafter.fresh(), model, policy, prompts, cap=2, max_tokens=6, lengths=[6, 6],
                      prefill_chunk=chunk) for policy in ("none", "fixed:4")]
    order: list[str] = []
    for run in runs:
        run.step = lambda *, shared, run=run, step=run.step: (order.append(run.orchestrator.budget.policy.kind),
                                                              step(shared=shared))
    interleave(runs)
    assert order[:6] == ["none", "fixed"] * 3
    assert max(r.orchestrator.records[0].prefill_tokens[0] for r in runs) == chunk  # prefilled in chunks
    assert runs[0].outputs and runs[0].outputs == {k.replace("fixed4", "none"): v for k, v in runs[1].outputs.items()}
    assert all(len(out) == 6 for out in runs[0].outputs.values())

def test_stop_token_stop_string_and_max_tokens(engine, datastore, tokenizer, prompt_ids, reference):
    orchestrator = make_orchestrator(engine, datastore, "goodput", tokenizer=tokenizer)
    ref = reference[0]
    stop_token = ref[5]
    cut = ref.index(stop_token)
    full_text = tokenizer.decode(ref)
    stop_string = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    results = run_all(orchestrator, [
        GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=24, stop_token_ids=(stop_token,)),
        GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=24, stop_strings=(stop_string,)),
        GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=1),
        GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=7),
    ])
    by_stop, by_string, one, seven = results.values()
    assert by_stop["tokens"] == ref[: cut + 1] and by_stop["finish"] == FinishReason.STOP
    assert by_string["finish"] == FinishReason.STOP
    assert by_string["text"] == full_text[: full_text.index(stop_string)]
    assert one["tokens"] == ref[:1] and one["finish"] == FinishReason.LENGTH
    assert seven["tokens"] == ref[:7] and seven["finish"] == FinishReason.LENGTH


def test_stop_strings_keep_what_plain_decoding_keeps(engine, datastore, tokenizer):
    # A speculative step brings several tokens at once; plain decoding looks for the stop strings after each one. So
    # it outputs no token after the one a stop string ends in, and of two stop strings it stops at the one the text
    # completes first, whichever is listed first. Before, a speculating request output the rest of the step's tokens
    # (and counted them), and stopped at the first listed stop string that the step's text held.
    prompt = tuple(tokenizer.encode("Copy this line five times: The cat sat on the mat. The cat sat on the mat.").ids)
    (ref,), _ = generate(engine, [list(prompt)], max_new_tokens=32, id_prefix="copy")
    text = tokenizer.decode(ref)
    first, later = (tokenizer.decode([ref[i]]).strip() for i in (2, 5))  # words of the first copied line
    assert first and later and first not in later and text.index(first) + len(first) <= text.index(later)
    kept = next(k for k in range(1, len(ref) + 1) if first in tokenizer.decode(ref[:k]))
    outputs = {}
    for policy in ("none", "fixed:16", "goodput"):
        steps: list[list[int]] = []
        orchestrator = make_orchestrator(engine, datastore, policy, tokenizer=tokenizer)
        free_before = engine.free_blocks()
        orchestrator.submit(GenerationRequest(prompt_ids=prompt, max_tokens=32, stop_strings=(later, first)),
                            lambda out: steps.append(out) if out.token_ids or out.finished else None)
        orchestrator.run_until_idle(max_steps=200)
        assert engine.free_blocks() == free_before
        outputs[policy] = ([t for out in steps for t in out.token_ids], "".join(out.text for out in steps),
                           steps[-1].finish_reason)
        if policy != "none":  # one step brought `first` and `later` at once, or equal outputs would say nothing
            assert len(steps) < kept
    assert outputs["none"] == (ref[:kept], text[:text.index(first)], FinishReason.STOP)
    assert outputs["fixed:16"] == outputs["goodput"] == outputs["none"]


@pytest.mark.parametrize("policy", ["fixed:16", "goodput"])
def test_a_request_that_fills_the_context_gets_trees_that_fit_it(engine, datastore, tokenizer, policy):
    # A repetitive prompt drafts long chains from its own index to the very end: the engine verifies at most
    # context + root + nodes = max_context positions, and refused larger steps, which stopped the serving loop.
    ids = tuple(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 100).ids[: engine.max_context - 24])
    plain, _ = generate(engine, [list(ids)], max_new_tokens=24, id_prefix="full")
    orchestrator = make_orchestrator(engine, datastore, policy)
    results = run_all(orchestrator, [GenerationRequest(prompt_ids=ids, max_tokens=24, ignore_eos=True),
                                     GenerationRequest(prompt_ids=ids[:50], max_tokens=2, ignore_eos=True)])
    full, two = results.values()
    assert full["tokens"] == plain[0] and full["finish"] == FinishReason.LENGTH
    assert full["stats"].accepted > 0  # it speculated up to the end of the context
    # A request with one token left gets it from the step's bonus token: it is sent no nodes.
    assert len(two["tokens"]) == 2 and two["stats"].drafted == 0


def test_a_datastore_of_a_larger_vocabulary_is_refused_before_any_step(engine, tmp_path):
    # Its continuations can hold ids the target does not have (this one's do): the engine refused such a tree and
    # with it the whole step, which stopped the serving loop.
    vocab = engine.vocab_size
    doc = np.array([5, 6, 7, 8, vocab + 3, vocab + 4] * 5, np.int32)
    wide = Datastore.open(build_from_token_docs([doc], tmp_path / "wide", vocab_size=vocab + 10, tokenizer_id="wide"))
    with pytest.raises(ValueError, match=rf"beyond the target model's vocabulary \({vocab} ids\).*--tokenizer"):
        make_orchestrator(engine, wide, "fixed:4")
    make_orchestrator(engine, Datastore.open(build_from_token_docs([doc % vocab], tmp_path / "fits", vocab_size=vocab,
                                                                   tokenizer_id="fits")), "fixed:4")  # same size: fine


def test_eos_ends_a_request(engine, datastore, tokenizer):
    chat = "<|im_start|>user\nSay just the word yes.<|im_end|>\n<|im_start|>assistant\n"
    ids = tuple(tokenizer.encode(chat).ids)
    plain, _ = generate(engine, [list(ids)], max_new_tokens=40, id_prefix="eos")
    assert plain[0][-1] in engine.eos_token_ids, "this prompt should end with EOS within 40 tokens"
    results = run_all(make_orchestrator(engine, datastore, "goodput"), [GenerationRequest(prompt_ids=ids, max_tokens=40)])
    (only,) = results.values()
    assert only["tokens"] == plain[0] and only["finish"] == FinishReason.STOP
    ignore = run_all(make_orchestrator(engine, datastore, "goodput"),
                     [GenerationRequest(prompt_ids=ids, max_tokens=len(plain[0]) + 3, ignore_eos=True)])
    assert len(next(iter(ignore.values()))["tokens"]) == len(plain[0]) + 3


def test_cancel_mid_stream_frees_kv(engine, datastore, prompt_ids, reference):
    orchestrator = make_orchestrator(engine, datastore, "goodput")
    free_before = engine.free_blocks()
    outputs = {}
    ids = [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24),
                               lambda out: outputs.setdefault(out.request_id, []).append(out)) for p in prompt_ids[:2]]
    for _ in range(3):
        orchestrator.step()
    assert engine.free_blocks() < free_before
    assert orchestrator.cancel(ids[0]) and not orchestrator.cancel(ids[0])
    assert outputs[ids[0]][-1].finish_reason == FinishReason.CANCELLED
    orchestrator.run_until_idle()
    assert sum((o.token_ids for o in outputs[ids[1]]), []) == reference[1]
    assert engine.free_blocks() == free_before


def test_a_callback_that_raises_cancels_its_own_request_only(engine, datastore, prompt_ids, reference, caplog):
    orchestrator = make_orchestrator(engine, datastore, "goodput")
    free_before = engine.free_blocks()
    outputs: dict[str, list] = {}
    broken_calls = []

    def collect(out):
        outputs.setdefault(out.request_id, []).append(out)

    def broken(out):  # a client whose callback fails on its third update
        broken_calls.append(out)
        if len(broken_calls) == 3:
            raise ConnectionResetError("client went away")

    ids = [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24), collect) for p in prompt_ids[:3]]
    broken_id = orchestrator.submit(GenerationRequest(prompt_ids=prompt_ids[3], max_tokens=24), broken)
    with caplog.at_level("ERROR", logger="orchestrator.core"):
        orchestrator.run_until_idle(max_steps=500)
    assert orchestrator.idle
    assert [sum((o.token_ids for o in outputs[i]), []) for i in ids] == reference[:3]
    assert all(outputs[i][-1].finish_reason == FinishReason.LENGTH for i in ids)
    # cancelled at its third update: no later output reached the broken callback, and its KV blocks are free
    assert len(broken_calls) == 3 and orchestrator.callback_errors == 1
    assert sum((o.token_ids for o in broken_calls), []) == reference[3][: sum(len(o.token_ids) for o in broken_calls)]
    assert engine.free_blocks() == free_before
    assert any(broken_id in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_request_the_engine_refuses_fails_alone(engine, datastore, prompt_ids, reference, micro_batches):
    orchestrator = make_orchestrator(engine, datastore, "goodput", micro_batches=micro_batches)
    free_before = engine.free_blocks()
    outputs: dict[str, list] = {}
    ids = [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24),
                               lambda out: outputs.setdefault(out.request_id, []).append(out)) for p in prompt_ids[:3]]
    for _ in range(3):
        orchestrator.step()
    # The engine forgets one request behind the orchestrator's back: its next verify refuses it (RequestError).
    engine.release(ids[1])
    orchestrator.run_until_idle(max_steps=500)
    assert orchestrator.idle and orchestrator.engine_refusals == 1
    last = outputs[ids[1]][-1]
    assert last.finish_reason == FinishReason.ERROR and "unknown request" in last.error and ids[1] in last.error
    for i in (0, 2):
        assert sum((o.token_ids for o in outputs[ids[i]]), []) == reference[i]
    assert engine.free_blocks() == free_before
    # and the orchestrator serves on
    results = run_all(orchestrator, [GenerationRequest(prompt_ids=prompt_ids[4], max_tokens=24)])
    assert [r["tokens"] for r in results.values()] == [reference[4]]


def test_a_commit_the_engine_refuses_fails_that_request_alone(engine, datastore, prompt_ids, reference):
    orchestrator = make_orchestrator(engine, datastore, "goodput")
    free_before = engine.free_blocks()
    outputs: dict[str, list] = {}
    ids: list[str] = []

    def collect(out):
        outputs.setdefault(out.request_id, []).append(out)
        # The first request's third update comes inside a step, between the batch's verify and the next request's
        # commit: the engine forgets that request there, so its commit is refused.
        if out.request_id == ids[0] and len(outputs[ids[0]]) == 3:
            engine.release(ids[1])

    ids += [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24), collect) for p in prompt_ids[:3]]
    orchestrator.run_until_idle(max_steps=500)
    assert orchestrator.engine_refusals == 1 and orchestrator.callback_errors == 0
    last = outputs[ids[1]][-1]
    assert last.finish_reason == FinishReason.ERROR and last.server_error and "unknown request" in last.error
    for i in (0, 2):
        assert sum((o.token_ids for o in outputs[ids[i]]), []) == reference[i]
    assert engine.free_blocks() == free_before


def test_a_prompt_the_engine_refuses_between_chunks_fails_alone(engine, datastore, prompt_ids, reference):
    orchestrator = make_orchestrator(engine, datastore, "goodput", prefill_chunk=8)
    free_before = engine.free_blocks()
    outputs: dict[str, list] = {}
    ids = [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24),
                               lambda out: outputs.setdefault(out.request_id, []).append(out))
           for p in (prompt_ids[3], prompt_ids[0])]
    orchestrator.step()
    assert list(orchestrator.prefilling) == [ids[0]]  # 8 of its prompt tokens are in
    engine.release(ids[0])
    orchestrator.run_until_idle(max_steps=500)
    assert orchestrator.engine_refusals == 1 and outputs[ids[0]][-1].finish_reason == FinishReason.ERROR
    assert sum((o.token_ids for o in outputs[ids[1]]), []) == reference[0]
    assert engine.free_blocks() == free_before


@pytest.mark.parametrize("policy, micro_batches", [("fixed:4", 2), ("goodput", 2), ("goodput", 3)])
def test_micro_batches_take_turns_losslessly(engine, datastore, prompt_ids, reference, policy, micro_batches):
    # SPIN's pipeline forced on the CPU: each step verifies one micro-batch on the verify worker while this thread
    # drafts the next one. Mixed lengths make the micro-batches change as requests finish and new ones are admitted.
    orchestrator = make_orchestrator(engine, datastore, policy, max_running=5, micro_batches=micro_batches)
    free_before = engine.free_blocks()
    lengths = [24 if i % 2 else 11 for i in range(len(prompt_ids))]
    requests = [GenerationRequest(prompt_ids=p, max_tokens=n) for p, n in zip(prompt_ids, lengths)]
    results = run_all(orchestrator, requests)
    orchestrator.close()
    assert [r["tokens"] for r in results.values()] == [ref[:n] for ref, n in zip(reference, lengths)]
    assert engine.free_blocks() == free_before
    records = list(orchestrator.records)
    turns = [r for r in records if r.micro_batches == micro_batches]
    assert turns and max(r.batch for r in turns) <= -(-5 // micro_batches)  # a share of the 5 running, per verify
    assert sum(r.overlapped_draft_s > 0 for r in turns) > len(turns) // 2  # the next micro-batch was drafted meanwhile
    assert sum(r["stats"].accepted for r in results.values()) > 0
    assert sum(r["stats"].steps for r in results.values()) == sum(r.batch for r in records)


def test_cancel_between_micro_batches_drops_the_tree_drafted_ahead(engine, datastore, prompt_ids, reference):
    orchestrator = make_orchestrator(engine, datastore, "fixed:4", max_running=4, micro_batches=2)
    free_before = engine.free_blocks()
    outputs: dict[str, list] = {}
    ids = [orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24),
                               lambda out: outputs.setdefault(out.request_id, []).append(out), request_id=f"c{i}")
           for i, p in enumerate(prompt_ids[:4])]
    first = orchestrator.step()  # verifies c0 and c1 while c2 and c3 are drafted ahead
    assert first.batch == 2 and first.micro_batches == 2 and first.drafted_ahead == 0  # nothing was drafted yet
    assert orchestrator.cancel("c2")  # drafted ahead, not verified yet
    assert outputs["c2"][-1].finish_reason == FinishReason.CANCELLED
    second = orchestrator.step()
    assert second.batch == 1 and second.drafted_ahead == 1  # c3 alone, on its tree drafted ahead: c2's went with it
    orchestrator.run_until_idle()
    orchestrator.close()
    for i in (0, 1, 3):
        assert sum((o.token_ids for o in outputs[ids[i]]), []) == reference[i]
    assert engine.free_blocks() == free_before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_micro_batches_are_refused_by_name(engine, datastore, bad):
    from orchestrator.serving.stack import ServingConfig

    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        make_orchestrator(engine, datastore, "goodput", micro_batches=bad)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        ServingConfig(micro_batches=bad)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_max_running_that_admits_nothing_is_refused(engine, datastore, bad):
    # max_running 0 admitted no request ever: every submitted request waited forever
    from orchestrator.serving.stack import ServingConfig

    with pytest.raises(ValueError, match="max_running must be an int >= 1"):
        make_orchestrator(engine, datastore, "goodput", max_running=bad)
    with pytest.raises(ValueError, match="max_running must be an int >= 1"):
        ServingConfig(max_running=bad)


def test_pipelining_pays_only_where_hidden_drafting_outweighs_splitting_the_batch():
    # Llama-3.1-8B on an H100. 16 plain requests: a step streams 16 GB of weights (~5 ms), so splitting them costs
    # nearly one more step, and pays only once drafting them takes longer than that. 64 requests of 16 tokens: the
    # step is compute-bound and two half-batch steps cost hardly more than one, so a little drafting already pays.
    from orchestrator.core import pipelining_pays
    from orchestrator.roofline import hardware

    shape = ModelShape.from_config(Path(__file__).resolve().parents[1] / "tools/model_shapes/llama-3.1-8b.json")
    model = StepTimeModel(shape, hardware("H100-SXM"), dtype="bfloat16")
    context, plain = np.full(16, 1000.0), np.ones(16)
    one_step = model.predict(plain, context)
    assert not pipelining_pays(model, plain, context, 0.5 * one_step / 16)
    assert pipelining_pays(model, plain, context, 3 * one_step / 16)
    wide, deep = np.full(64, 1000.0), np.full(64, 16.0)
    deep_step = model.predict(deep, wide)
    assert 2 * model.predict(deep[:32], wide[:32]) < 1.05 * deep_step
    assert pipelining_pays(model, deep, wide, 0.1 * deep_step / 64)
    assert not pipelining_pays(model, np.ones(64), wide, 0.1 * deep_step / 64)
    assert not pipelining_pays(model, plain[:1], context[:1], 3 * one_step)  # one request cannot be split


def test_admission_never_overcommits_kv(datastore, prompt_ids, reference):
    from trt_engines.torch_engine import TorchEngine

    small = TorchEngine("default", dtype=torch.float32, num_blocks=24, block_size=16, max_context=1024)
    orchestrator = make_orchestrator(small, datastore, "fixed:16", max_running=8)
    requests = [GenerationRequest(prompt_ids=p, max_tokens=24) for p in prompt_ids]
    requests.append(GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=500))  # can never fit
    results: dict[str, list] = {}
    ids = [orchestrator.submit(r, lambda out: results.setdefault(out.request_id, []).append(out)) for r in requests]
    peak_running = 0
    while not orchestrator.idle:
        orchestrator.step()
        assert sum(orchestrator._reserved.values()) <= small.total_blocks()
        assert small.free_blocks() >= 0
        peak_running = max(peak_running, len(orchestrator.running))
    assert 1 <= peak_running < len(prompt_ids)  # the ledger held some requests back
    for rid, ref in zip(ids, reference):
        assert sum((o.token_ids for o in results[rid]), []) == ref
    too_big = results[ids[-1]][-1]
    assert too_big.finish_reason == FinishReason.ERROR and "KV blocks" in too_big.error
    assert small.free_blocks() == small.total_blocks()


class FlakyDrafter(Drafter):
    """A real drafter that fails every other call: the step must fall back to plain decoding."""

    calls = None  # set after construction, so the constructor's warm-up call goes through

    def draft(self, batch):
        if self.calls is not None:
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("injected drafter failure")
        return super().draft(batch)


def test_drafter_failure_falls_back_to_plain_decoding(engine, datastore, prompt_ids, reference):
    flaky = FlakyDrafter(DrafterConfig(), datastores=[datastore])
    flaky.calls = 0
    orchestrator = make_orchestrator(engine, datastore, "fixed:8", drafter=flaky)
    results = run_all(orchestrator, [GenerationRequest(prompt_ids=p, max_tokens=24) for p in prompt_ids])
    assert [r["tokens"] for r in results.values()] == reference
    assert orchestrator.drafter_fallbacks > 0
    assert sum(r["stats"].fallbacks for r in results.values()) == orchestrator.drafter_fallbacks


class SlowDrafter(Drafter):
    """A real drafter whose every third call finishes late (it sleeps first, then drafts and updates nothing)."""

    calls = None
    busy = False

    def draft(self, batch):
        self.busy = True
        try:
            if self.calls is not None:
                self.calls += 1
                if self.calls % 3 == 0:
                    time.sleep(0.3)
            return super().draft(batch)
        finally:
            self.busy = False

    def extend(self, request_id, accepted_ids):
        assert not self.busy, "the drafter's state changed while a draft call was running"
        return super().extend(request_id, accepted_ids)


def test_drafter_timeout_falls_back_and_never_races_the_late_call(engine, datastore, prompt_ids, reference):
    slow = SlowDrafter(DrafterConfig(), datastores=[datastore])
    slow.calls = 0
    orchestrator = make_orchestrator(engine, datastore, "fixed:8", drafter=slow, draft_timeout_s=0.1)
    results = run_all(orchestrator, [GenerationRequest(prompt_ids=p, max_tokens=24) for p in prompt_ids])
    assert [r["tokens"] for r in results.values()] == reference
    assert 0 < orchestrator.drafter_timeouts <= orchestrator.drafter_fallbacks
    assert sum(r["stats"].fallbacks for r in results.values()) == orchestrator.drafter_fallbacks
    assert sum(r["stats"].accepted for r in results.values()) > 0  # the punctual calls still speculated
    # the drafting thread runs its kernels on itself alone (a second pool of OpenMP workers slows the engine's)
    assert orchestrator._draft_pool.submit(numba.get_num_threads).result() == 1
    orchestrator.close()
    assert not drafter_threads()
    again = run_all(orchestrator, [GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=24)])
    assert [r["tokens"] for r in again.values()] == reference[:1]  # once closed, it drafts on the calling thread
    with pytest.raises(ValueError, match="draft_timeout_s"):
        make_orchestrator(engine, datastore, "fixed:8", draft_timeout_s=0)


class WatchedDrafter(Drafter):
    """A real drafter that checks, at each draft call, that it has indexed each request's prompt + output so far
    (`expected`, set by the test), and counts the calls that give it tokens."""

    expected = None  # request id -> the tokens the drafter should have indexed for it by now (the test sets it,
    checks = None    # with the list each draft call's check goes to)
    extends = 0

    def draft(self, batch):
        if self.expected is not None:
            self.checks.append(all(self.input_index.tokens(rid).tolist() == self.expected(rid) for rid, _ in batch))
        return super().draft(batch)

    def extend(self, request_id, accepted_ids):
        self.extends += 1
        return super().extend(request_id, accepted_ids)


@pytest.mark.parametrize("policy", ["fixed:4", "none"])
def test_the_drafter_sees_every_token_when_it_drafts_and_whole_outputs_when_requests_finish(
        engine, datastore, prompt_ids, reference, policy):
    drafter = WatchedDrafter(DrafterConfig(), datastores=[datastore])
    orchestrator = make_orchestrator(engine, datastore, policy, drafter=drafter, max_running=3)
    prompts = {f"q{i}": list(p) for i, p in enumerate(prompt_ids)}
    streamed: dict[str, list[int]] = {rid: [] for rid in prompts}
    drafter.checks, drafter.extends = [], 0
    drafter.expected = lambda rid: prompts[rid] + streamed[rid]
    for rid, p in prompts.items():
        orchestrator.submit(GenerationRequest(prompt_ids=p, max_tokens=24),
                            lambda out: streamed[out.request_id].extend(out.token_ids), request_id=rid)
    orchestrator.run_until_idle(max_steps=2000)
    assert [streamed[rid] for rid in prompts] == reference
    # the output history holds every finished request's whole output, its last step's tokens included
    assert sorted(map(tuple, drafter.input_index.history())) == sorted(map(tuple, reference))
    if policy == "none":  # plain decoding gives the drafter nothing until a request finishes
        assert drafter.checks == [] and drafter.extends == len(prompts)
    else:
        assert len(drafter.checks) > 10 and all(drafter.checks)


def test_bad_requests_are_refused_and_change_nothing(engine, datastore, prompt_ids):
    orchestrator = make_orchestrator(engine, datastore, "goodput")
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest(prompt_ids=())
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationRequest(prompt_ids=(1, 2), max_tokens=0)
    with pytest.raises(ValueError, match="vocab|lie in"):
        orchestrator.submit(GenerationRequest(prompt_ids=(1, engine.vocab_size)))
    with pytest.raises(ValueError, match="context"):
        orchestrator.submit(GenerationRequest(prompt_ids=(1,) * 1000, max_tokens=100))
    with pytest.raises(ValueError, match="tokenizer"):
        orchestrator.submit(GenerationRequest(prompt_ids=(1, 2), stop_strings=("x",)))
    orchestrator.submit(GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        orchestrator.submit(GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=2), request_id="dup")
    assert len(orchestrator.waiting) == 1
    orchestrator.run_until_idle()


def drafter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("drafter")]


def test_a_runner_builds_from_a_factory_on_its_own_thread_and_runs_calls_there(engine, datastore, prompt_ids,
                                                                               reference):
    # One thread runs every parallel kernel of a server (libgomp keeps a worker pool per thread that starts a
    # parallel region: `orchestrator.runner`), so the runner builds the orchestrator itself from a factory and runs
    # other such work (`call`) between its steps. Errors of either come back to the caller.
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return make_orchestrator(engine, datastore, "goodput")

    runner = OrchestratorRunner(build).start()
    assert runner.call(threading.current_thread) is built_on[0] is not threading.current_thread()
    with pytest.raises(ZeroDivisionError):
        runner.call(lambda: 1 / 0)
    done = runner.generate(GenerationRequest(prompt_ids=prompt_ids[1], max_tokens=24), timeout=120)
    assert done.token_ids == reference[1] and runner.error is None
    runner.shutdown()
    assert not runner.alive
    with pytest.raises(RuntimeError, match="not running"):
        runner.call(lambda: None)

    def broken():
        raise ValueError("no such model")

    failed = OrchestratorRunner(broken)
    with pytest.raises(ValueError, match="no such model"):
        failed.start()
    assert not failed.alive and failed.orchestrator is None
    with pytest.raises(RuntimeError, match="runner stopped before it took the command.*no such model"):
        failed.submit(GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=4), lambda out: None)


def test_runner_streams_concurrently_and_cancels_abandoned_streams(engine, datastore, prompt_ids, reference):
    # With a (never reached) draft timeout, so that shutdown must also stop the drafting thread.
    runner = OrchestratorRunner(make_orchestrator(engine, datastore, "goodput", draft_timeout_s=60.0)).start()
    free_before = engine.free_blocks()

    async def consume(p, limit=None):
        tokens = []
        async for out in runner.stream(GenerationRequest(prompt_ids=p, max_tokens=24)):
            tokens += out.token_ids
            if limit and len(tokens) >= limit:
                break  # a client that goes away mid-stream
        return tokens

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompt_ids[:3]), consume(prompt_ids[3], limit=2))

    *complete, partial = asyncio.run(main())
    assert complete == reference[:3] and len(partial) >= 2
    blocking = runner.generate(GenerationRequest(prompt_ids=prompt_ids[4], max_tokens=24), timeout=120)
    assert blocking.token_ids == reference[4] and blocking.finish_reason == FinishReason.LENGTH
    runner.shutdown()
    assert not runner.alive and runner.error is None and not drafter_threads()
    assert engine.free_blocks() == free_before


def test_a_runner_serves_on_after_a_client_callback_raises(engine, datastore, prompt_ids, reference):
    runner = OrchestratorRunner(make_orchestrator(engine, datastore, "goodput")).start()
    free_before = engine.free_blocks()
    failed = threading.Event()

    def broken(out):
        failed.set()
        raise RuntimeError("Event loop is closed")  # what `call_soon_threadsafe` raises once a client's loop is gone

    runner.submit(GenerationRequest(prompt_ids=prompt_ids[0], max_tokens=24), broken)
    assert failed.wait(60)
    completion = runner.generate(GenerationRequest(prompt_ids=prompt_ids[1], max_tokens=24), timeout=120)
    assert completion.token_ids == reference[1] and completion.finish_reason == FinishReason.LENGTH
    assert runner.alive and runner.error is None
    runner.shutdown()
    assert runner.orchestrator.callback_errors == 1 and engine.free_blocks() == free_before
