"""TensorRT-LLM integration: tree -> path reduction, step requests, output -> tree mapping, the engine's verify loop,
build-command assembly, the custom-drafter planner, and the Triton pairing export.

Everything except the `gpu` tests runs without TensorRT-LLM. Where the engine needs an executor, these tests use a
stand-in `StepBackend` that answers the way TensorRT-LLM's external-draft-token requests are documented to answer
(accepted draft prefix + bonus token, greedy). Those are tests of OUR mapping and bookkeeping, not TensorRT-LLM
results; the `gpu` tests at the end run the real thing wherever `tensorrt_llm` imports.
"""

from __future__ import annotations

import itertools
import json
import py_compile
import shlex
import shutil
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datastore import build_from_token_docs
from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import DraftTree
from drafter.trtllm_drafter import (
    LinearDraftPlanner,
    RequestView,
    trtllm_drafter_classes,
)
from orchestrator.acceptance import accept
from orchestrator.cli import main as cli_main
from trt_engines.base import RequestError, SamplingParams, TargetEngine, VerifyItem
from trt_engines.prepare import default_model_dir, is_complete
from trt_engines.tensorrt_llm_engine import (
    UNKNOWN_TOKEN,
    StepRequest,
    TensorRTLLMEngine,
    TensorRTLLMUnavailable,
    import_executor_bindings,
    prefill_request,
    targets_from_output,
    verify_request,
)
from trt_engines.trtllm_build import (
    BUILD_COMMANDS_FILE,
    BUILD_INFO_FILE,
    GPUUnavailable,
    check_toolchain,
    gpu_names,
    plan_build,
    read_engine_config,
)

HYP = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
_ids = itertools.count()


@st.composite
def trees(draw, max_nodes: int = 14, vocab: int = 6):
    """Small trees over a tiny vocabulary, so duplicate siblings and target/draft collisions are common."""
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    probs = draw(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]), min_size=n, max_size=n))
    return DraftTree.from_arrays(tokens=tokens, parents=parents, probs=probs)


# ---- tree -> path reduction -------------------------------------------------------------------------------------


def _brute_best_path(tree: DraftTree, max_len: int | None, below: int = -1) -> list[int]:
    """Every node in the subtree under `below` within max_len, scored by the sum of probs along its path from below."""
    best, best_gain = [], -1.0
    for node in range(len(tree)):
        path = tree.path_to(node).tolist()
        if below >= 0:
            if below not in path[:-1]:
                continue
            path = path[path.index(below) + 1:]
        if max_len is not None and len(path) > max_len:
            continue
        gain = float(sum(np.float64(tree.probs[i]) for i in path))
        if gain > best_gain:  # strict: the first (lowest index) of equal gains wins
            best, best_gain = path, gain
    return best


def test_best_path_nodes_docstring_example():
    tree = DraftTree.from_arrays(tokens=[10, 11, 12, 13], parents=[-1, 0, -1, 2], probs=[0.9, 0.2, 0.6, 0.55])
    assert tree.best_path_nodes().tolist() == [2, 3]
    assert tree.best_path_nodes(1).tolist() == [0]
    assert tree.best_path_nodes(below=0).tolist() == [1]
    assert tree.best_path_nodes(below=1).tolist() == []  # a leaf has nothing below it
    assert DraftTree.empty().best_path_nodes().tolist() == [] and tree.best_path_nodes(0).tolist() == []
    with pytest.raises(ValueError, match="below"):
        tree.best_path_nodes(below=4)
    with pytest.raises(ValueError, match="max_len"):
        tree.best_path_nodes(-1)


def test_zero_probability_children_do_not_lengthen_the_path():
    tree = DraftTree.from_arrays(tokens=[1, 2, 3], parents=[-1, 0, 1], probs=[0.5, 0.0, 0.0])
    assert tree.best_path_nodes().tolist() == [0]  # ties go to the lowest index: the parent


@HYP
@given(trees(), st.one_of(st.none(), st.integers(0, 6)), st.data())
def test_best_path_nodes_is_the_brute_force_best_path_and_agrees_with_best_path(tree, max_len, data):
    nodes = tree.best_path_nodes(max_len)
    assert nodes.tolist() == _brute_best_path(tree, max_len)
    assert tree.tokens[nodes].tolist() == tree.best_path(max_len).tokens.tolist()  # the existing reduction
    assert [int(tree.parents[i]) for i in nodes] == [-1, *nodes[:-1].tolist()][: len(nodes)]  # a root path
    if len(tree):
        below = data.draw(st.integers(-1, len(tree) - 1))
        sub = tree.best_path_nodes(max_len, below=below)
        assert sub.tolist() == _brute_best_path(tree, max_len, below)
        assert [int(tree.parents[i]) for i in sub] == [below, *sub[:-1].tolist()][: len(sub)]


# ---- step requests ----------------------------------------------------------------------------------------------


def test_step_requests_carry_the_whole_sequence_the_draft_and_k_plus_one_outputs():
    step = verify_request([1, 2, 3], 4, np.array([5, 6], np.int32), end_id=2, pad_id=0)
    assert step == StepRequest((1, 2, 3, 4), 3, (5, 6), 2, 0)
    assert step.executor_kwargs() == {
        "input_token_ids": [1, 2, 3, 4], "max_tokens": 3, "streaming": False, "sampling_config": {"beam_width": 1},
        "output_config": {"exclude_input_from_output": True}, "end_id": 2, "pad_id": 0,
        "external_draft_tokens_config": {"tokens": [5, 6]},
    }
    plain = verify_request([1], 7, [])
    assert plain.max_tokens == 1 and "external_draft_tokens_config" not in plain.executor_kwargs()
    assert "end_id" not in plain.executor_kwargs() and "pad_id" not in plain.executor_kwargs()
    assert prefill_request([9, 8]).executor_kwargs()["input_token_ids"] == [9, 8]
    assert prefill_request([9, 8]).max_tokens == 1


# ---- output -> tree mapping -------------------------------------------------------------------------------------


def test_targets_from_output_worked_example():
    tree = DraftTree.from_arrays(tokens=[7, 8, 9], parents=[-1, 0, 0])  # root -> a(7) -> {b(8), x(9)}
    targets, need = targets_from_output(tree, [7, 8, 5])  # path a, b accepted, bonus 5
    assert targets.tolist() == [7, 8, 5, UNKNOWN_TOKEN] and need is None
    verdict = accept(tree, targets)
    assert verdict.accepted_nodes.tolist() == [0, 1] and verdict.bonus_token == 5
    targets, need = targets_from_output(tree, [7, 9])  # the target picks the off-path sibling x: need its target
    assert targets.tolist() == [7, 9, UNKNOWN_TOKEN, UNKNOWN_TOKEN] and need == 2
    with pytest.raises(ValueError, match="no token"):
        targets_from_output(tree, [])


class OracleBackend:
    """Stand-in for TensorRT-LLM's executor with a deterministic greedy 'model' over a tiny vocabulary: the token after
    a sequence is a hash of its last 3 tokens. Answers like an external-draft-token request: the draft prefix equal to
    the greedy tokens, then the bonus token; `keep_decoding` also decodes on to max_tokens (the other reading of the
    executor's contract, which the engine must survive too)."""

    def __init__(self, vocab: int = 6, keep_decoding: bool = False) -> None:
        self.vocab, self.keep_decoding, self.calls = vocab, keep_decoding, []

    def next_token(self, seq) -> int:
        return zlib.crc32(bytes(int(t) % 251 for t in seq[-3:])) % self.vocab

    def run(self, steps):
        self.calls.append(list(steps))
        outputs = []
        for step in steps:
            seq, out = list(step.input_token_ids), []
            for d in step.draft_tokens:
                g = self.next_token(seq)
                out.append(g)
                seq.append(g)
                if g != d:
                    break
            else:
                g = self.next_token(seq)
                out.append(g)
                seq.append(g)
            while self.keep_decoding and len(out) < step.max_tokens:
                out.append(self.next_token(seq))
                seq.append(out[-1])
            outputs.append(out)
        return outputs

    def shutdown(self) -> None:
        pass


def _engine_folder(path, *, max_draft_len=4, max_seq_len=64, max_input_len=None, vocab=6, mode=2, eos=(5,)):
    """An engine folder as `trtllm-build` + `build-engine` write it (config.json fields we read, build_info.json)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "version": "1.2.0", "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16",
                                                  "vocab_size": vocab},
        "build_config": {"max_batch_size": 4, "max_input_len": max_input_len or max_seq_len - 1,
                         "max_seq_len": max_seq_len, "max_num_tokens": 8192, "max_draft_len": max_draft_len,
                         "speculative_decoding_mode": mode, "plugin_config": {"tokens_per_block": 32}}}))
    (path / BUILD_INFO_FILE).write_text(json.dumps({"model_token_ids": {"eos_token_id": list(eos), "pad_token_id": 0}}))
    return path


def _full_targets(oracle: OracleBackend, context: list[int], tree: DraftTree) -> np.ndarray:
    """What a tree-verifying engine (TorchEngine) returns: the target token at the root and after every node."""
    out = [oracle.next_token(context)]
    for i in range(len(tree)):
        out.append(oracle.next_token(context + tree.tokens[tree.path_to(i)].tolist()))
    return np.asarray(out)


@HYP
@given(st.lists(trees(), min_size=1, max_size=3), st.booleans(), st.integers(1, 4))
def test_engine_verify_accepts_exactly_what_whole_tree_verification_accepts(tmp_path_factory, batch, keep, max_draft):
    oracle = OracleBackend(keep_decoding=keep)
    engine = TensorRTLLMEngine(_engine_folder(tmp_path_factory.mktemp("e"), max_draft_len=max_draft), backend=oracle)
    assert isinstance(engine, TargetEngine)
    ids = [f"r{next(_ids)}" for _ in batch]
    roots = [engine.add_request(rid, [1, 2, 3 + k], SamplingParams()) for k, rid in enumerate(ids)]
    for step in range(2):
        contexts = [engine._requests[rid].context + [engine._requests[rid].root] for rid in ids]
        out = engine.verify([VerifyItem(rid, tree) for rid, tree in zip(ids, batch)])
        assert out.timings["rounds"] >= 1 and len(oracle.calls[-1]) <= len(batch)
        for rid, tree, ctx, result in zip(ids, batch, contexts, out.results):
            got = accept(tree, result.target_tokens)
            want = accept(tree, _full_targets(oracle, ctx, tree))
            assert got.accepted_nodes.tolist() == want.accepted_nodes.tolist() and got.bonus_token == want.bonus_token
            engine.commit(rid, got.accepted_nodes, next_root=got.bonus_token)
            assert engine._requests[rid].context == ctx + got.new_tokens[:-1].tolist()
    first_verify = oracle.calls[len(batch)]  # after one prefill call per request
    assert all(len(s.draft_tokens) <= max_draft for s in first_verify)
    assert roots == [oracle.next_token([1, 2, 3 + k]) for k in range(len(batch))]


def test_engine_asks_again_when_the_target_takes_a_branch_the_path_dropped(tmp_path):
    """root -> a=5 (0.9) | b=2 (0.3) -> c=3 (0.3): the path sent is [a]; the target says 2, 3, 4. The answer to [a]
    covers only b, so the engine asks once more below b, and the step accepts b, c as whole-tree verification would."""

    class Truth(OracleBackend):
        def next_token(self, seq):
            return [1, 2, 3, 4, 5, 6][len(seq) - 3]  # the target's tokens after the 3-token prompt

    backend = Truth()
    engine = TensorRTLLMEngine(_engine_folder(tmp_path / "e"), backend=backend)
    assert engine.add_request("q", [0, 0, 0], SamplingParams()) == 1
    tree = DraftTree.from_arrays(tokens=[5, 2, 3], parents=[-1, -1, 1], probs=[0.9, 0.3, 0.3])
    out = engine.verify([VerifyItem("q", tree)])
    assert [s.draft_tokens for s in backend.calls[-2]] == [(5,)] and [s.draft_tokens for s in backend.calls[-1]] == [(3,)]
    assert out.timings["rounds"] == 2
    verdict = accept(tree, out.results[0].target_tokens)
    assert verdict.accepted_nodes.tolist() == [1, 2] and verdict.bonus_token == 4
    engine.commit("q", verdict.accepted_nodes, next_root=verdict.bonus_token)
    assert engine.context_length("q") == 3 + 3 and engine._requests["q"].root == 4


def test_engine_rejects_misuse_with_clear_errors(tmp_path):
    engine = TensorRTLLMEngine(_engine_folder(tmp_path / "e", max_seq_len=16), backend=OracleBackend())
    with pytest.raises(RequestError, match="greedy"):
        engine.add_request("s", [1, 2], SamplingParams(temperature=0.7))
    with pytest.raises(RequestError, match="vocabulary|lie in"):
        engine.add_request("v", [1, 99], SamplingParams())
    with pytest.raises(RequestError, match="no cache salt"):  # its executor shares blocks across all requests
        engine.add_request("salted", [1, 2, 3], SamplingParams(), cache_salt="tenant")
    root = engine.add_request("a", [1, 2, 3], SamplingParams())
    with pytest.raises(RequestError, match="commit without"):
        engine.commit("a", [], next_root=root)
    tree = DraftTree.chain([4, 4])
    result = engine.verify([VerifyItem("a", tree)]).results[0]
    verdict = accept(tree, result.target_tokens)
    wrong = (verdict.bonus_token + 1) % 6
    with pytest.raises(RequestError, match="disagree"):
        engine.commit("a", verdict.accepted_nodes, next_root=wrong)
    with pytest.raises(RequestError, match="unknown request"):
        engine.verify([VerifyItem("nope", tree)])
    short = TensorRTLLMEngine(_engine_folder(tmp_path / "f", max_seq_len=16, max_input_len=3), backend=OracleBackend())
    with pytest.raises(RequestError, match="max_input_len 3"):
        short.add_request("b", [1, 2, 3, 4, 5], SamplingParams())
    short.add_request("c", [1, 2, 3], SamplingParams())
    with pytest.raises(RequestError, match="re-submits the whole sequence"):  # context + root > max_input_len
        short.verify([VerifyItem("c", tree)])
    assert engine.blocks_needed(33) == 2 and engine.total_blocks() == 4 * 16 // 32
    engine.release("a")
    assert "a" not in engine.requests


def test_engine_folder_must_be_a_draft_tokens_external_engine(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        read_engine_config(tmp_path)
    with pytest.raises(ValueError, match="draft_tokens_external"):
        read_engine_config(_engine_folder(tmp_path / "plain", mode=1))
    with pytest.raises(ValueError, match="max_draft_len"):
        read_engine_config(_engine_folder(tmp_path / "zero", max_draft_len=0))
    config = read_engine_config(_engine_folder(tmp_path / "ok", eos=(2, 7)))
    assert (config.max_draft_len, config.max_seq_len, config.vocab_size, config.tokens_per_block) == (4, 64, 6, 32)
    assert config.eos_token_ids == (2, 7) and config.pad_token_id == 0
    assert read_engine_config(_engine_folder(tmp_path / "s", mode="DRAFT_TOKENS_EXTERNAL")).max_draft_len == 4


def test_missing_tensorrt_llm_is_a_clear_error():
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        with pytest.raises(TensorRTLLMUnavailable, match="tensorrt_llm==1.2"):
            import_executor_bindings()
        with pytest.raises(ImportError, match="TensorRT-LLM 1.2"):
            trtllm_drafter_classes()
    else:
        pytest.skip("tensorrt_llm is installed here")


@pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")
def test_engine_over_the_real_model_is_lossless_with_drafts(tmp_path):
    """The whole loop on real target tokens: a stand-in backend computes greedy tokens with TorchEngine (fp32), the
    drafter is ours; speculative output must equal plain greedy output token for token."""
    import torch

    from orchestrator.spec_loop import generate
    from trt_engines.torch_engine import TorchEngine

    torch.set_num_threads(2)
    reference = TorchEngine("default", dtype=torch.float32, num_blocks=16, max_context=256)

    class TorchBackend:
        def run(self, steps):
            logits = reference.debug_logits([list(s.input_token_ids) + list(s.draft_tokens) for s in steps])
            outputs = []
            for s, row in zip(steps, logits):
                greedy = row[len(s.input_token_ids) - 1:].argmax(-1).tolist()  # after input, then after each draft
                a = 0
                while a < len(s.draft_tokens) and s.draft_tokens[a] == greedy[a]:
                    a += 1
                outputs.append(greedy[: a + 1])
            return outputs

        def shutdown(self):
            pass

    engine = TensorRTLLMEngine(_engine_folder(tmp_path / "e", vocab=reference.vocab_size, max_seq_len=256,
                                              max_draft_len=6, eos=reference.eos_token_ids), backend=TorchBackend())
    prompt = [1, 504, 3458, 28, 253, 504, 3458, 28, 253, 504]  # repetitive, so the input index drafts
    plain, _ = generate(reference, [prompt], max_new_tokens=8)
    spec, stats = generate(engine, [prompt], max_new_tokens=8, draft_fn=_input_drafter(8))
    assert spec == plain
    assert stats[0].drafted > 0


def _input_drafter(budget: int):
    """spec_loop's draft_fn over our input-index drafter: start a request on first sight, then extend it."""
    drafter, seen = Drafter(DrafterConfig(sources="input")), {}

    def draft_fn(rid, tokens):
        if rid not in seen:
            drafter.start_request(rid, np.asarray(tokens, np.int32))
        else:
            drafter.extend(rid, np.asarray(tokens[seen[rid]:], np.int32))
        seen[rid] = len(tokens)
        return drafter.draft([(rid, budget)])[0]

    return draft_fn


# ---- build-engine -----------------------------------------------------------------------------------------------


def _hf_folder(path, arch="LlamaForCausalLM"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [arch], "eos_token_id": 2, "pad_token_id": 2}))
    return path


def test_build_commands_are_assembled_exactly(tmp_path):
    model = _hf_folder(tmp_path / "hf")
    plan = plan_build(model, tmp_path / "engine", max_draft_len=8, dtype="float16", max_batch_size=4,
                      max_seq_len=1024, python="/usr/bin/python3")
    engine, ckpt = str(tmp_path / "engine"), str(tmp_path / "engine" / "checkpoint")
    assert plan.convert_command() == ["/usr/bin/python3", "-m", "trt_engines.trtllm_build", "convert-checkpoint",
                                      "--model-dir", str(model), "--output-dir", ckpt, "--dtype", "float16",
                                      "--tp-size", "1"]
    assert plan.build_command() == [
        "trtllm-build", "--checkpoint_dir", ckpt, "--output_dir", engine, "--gemm_plugin", "float16",
        "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable",
        "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "8",
        "--max_batch_size", "4", "--max_input_len", "1023", "--max_seq_len", "1024"]
    script = tmp_path / "convert_checkpoint.py"
    script.write_text("")
    with_script = plan_build(model, tmp_path / "engine", max_draft_len=8, max_num_tokens=4096, convert_script=script,
                             python="py")
    assert with_script.convert_command() == ["py", str(script), "--model_dir", str(model), "--output_dir", ckpt,
                                             "--dtype", "bfloat16", "--tp_size", "1"]
    assert with_script.build_command()[-2:] == ["--max_num_tokens", "4096"]
    lines = plan.shell_script().splitlines()
    assert lines[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in lines
    assert [shlex.split(line) for line in lines[-2:]] == plan.commands()


@pytest.mark.parametrize("kwargs, match", [
    ({"arch": "GPT2LMHeadModel"}, "Llama-family"),
    ({"dtype": "int8"}, "dtype"),
    ({"max_input_len": 2048}, "max_input_len"),
    ({"max_draft_len": 0}, "max_draft_len"),
    ({"max_num_tokens": 16}, "max_num_tokens"),
    ({"convert_script": "/nonexistent/convert_checkpoint.py"}, "convert-script"),
])
def test_bad_build_arguments_are_rejected_by_name(tmp_path, kwargs, match):
    model = _hf_folder(tmp_path / "hf", kwargs.pop("arch", "LlamaForCausalLM"))
    args = {"max_draft_len": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_build(model, tmp_path / "engine", **args)


def test_build_engine_dry_run_writes_commands_and_versions(tmp_path, capsys):
    model = _hf_folder(tmp_path / "hf")
    engine = tmp_path / "engine"
    assert cli_main(["build-engine", "--model", str(model), "--engine-dir", str(engine), "--dry-run",
                     "--max-seq-len", "512"]) == 0
    info = json.loads((engine / BUILD_INFO_FILE).read_text())
    assert info["status"] == "planned" and info["plan"]["max_draft_len"] == 64  # the budget cap by default
    assert info["model_token_ids"]["eos_token_id"] == 2 and "pinned_tensorrt_llm" in info["versions"]
    script = (engine / BUILD_COMMANDS_FILE).read_text()
    assert [shlex.split(line) for line in script.splitlines()[-2:]] == info["commands"]
    assert "--speculative_decoding_mode draft_tokens_external" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("trtllm-build") is not None, reason="TensorRT-LLM is installed here")
def test_build_without_tensorrt_llm_names_the_fix(tmp_path, capsys):
    plan = plan_build(_hf_folder(tmp_path / "hf"), tmp_path / "engine", max_draft_len=4)
    with pytest.raises(TensorRTLLMUnavailable, match="trtllm-build` is not on PATH.*1.2"):
        check_toolchain(plan)
    assert cli_main(["build-engine", "--model", str(tmp_path / "hf"), "--engine-dir", str(tmp_path / "e")]) == 1
    assert "is not on PATH" in capsys.readouterr().err and not (tmp_path / "e").exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="nvidia-smi is installed here")
def test_missing_gpu_is_a_clear_error():
    with pytest.raises(GPUUnavailable, match="nvidia-smi"):
        gpu_names()


# ---- the drafter inside TensorRT-LLM's scheduler ----------------------------------------------------------------

PROMPT = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repetitive: the input index drafts 7, 8, 5, 6, ...


def test_planner_keeps_drafter_state_in_step_and_drafts_linear_paths():
    planner = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=3, draft_cap=8)
    twin = Drafter(DrafterConfig(sources="input"))  # driven directly, the way the orchestrator drives a drafter
    twin.start_request("t", np.asarray(PROMPT[:9], np.int32))
    twin.extend("t", np.asarray(PROMPT[9:], np.int32))
    (draft,) = planner.plan([RequestView(11, PROMPT, prompt_len=9)])
    tree = twin.draft([("t", 8)])[0]
    assert draft == tree.tokens[tree.best_path_nodes(3)].tolist() and 1 <= len(draft) <= 3
    assert planner.active == [11]
    twin.extend("t", np.asarray([7, 8], np.int32))
    (draft,) = planner.plan([RequestView(11, PROMPT + [7, 8], prompt_len=9)])  # only the new tokens are added
    tree = twin.draft([("t", 8)])[0]
    assert draft == tree.tokens[tree.best_path_nodes(3)].tolist()
    planner.release(11)
    planner.release(11)  # unknown ids are ignored
    assert planner.active == [] and not planner.drafter.active_requests


def test_budget_zero_disables_speculation_per_request():
    drop_second = lambda trees, context: [trees[0], DraftTree.empty()]  # a budget callable
    planner = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=4, draft_cap=8,
                                 budget=drop_second)
    first, second = planner.plan([RequestView(1, PROMPT, 9), RequestView(2, PROMPT, 9)])
    assert first and second == []
    off = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=4, draft_cap=lambda b: 0)
    assert off.plan([RequestView(1, PROMPT, 9)]) == [[]]

    def broken(trees, context):
        raise RuntimeError("budget failed")

    failing = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=4, budget=broken)
    assert failing.plan([RequestView(1, PROMPT, 9)]) == [[]] and failing.fallbacks == 1


def test_planner_releases_requests_it_stops_seeing():
    planner = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=2, max_idle_steps=2)
    planner.plan([RequestView("a", PROMPT, 9), RequestView("b", PROMPT, 9)])
    for _ in range(3):
        planner.plan([RequestView("a", PROMPT, 9)])
    assert planner.active == ["a"] and set(planner.drafter.active_requests) == {"a"}
    with pytest.raises(ValueError, match="max_draft_len"):
        LinearDraftPlanner(planner.drafter, max_draft_len=0)


# ---- Triton pairing ---------------------------------------------------------------------------------------------


def _model_config(path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_export_tensorrtllm_repository_renders_from_the_engine_folder(tmp_path, capsys):
    pytest.importorskip("tritonclient.grpc")
    engine = _engine_folder(tmp_path / "engine", max_draft_len=6, max_seq_len=1024, eos=(2,))
    repo = tmp_path / "repo"
    datastore = build_from_token_docs([[1, 2, 3, 4], [2, 3, 5]], tmp_path / "ds", vocab_size=8)
    assert cli_main(["export-triton-repo", "--tensorrtllm", str(repo), "--engine-dir", str(engine),
                     "--datastore", str(datastore), "--draft-budget", "12"]) == 0
    printed = capsys.readouterr().out.split()
    target = _model_config(repo / "tensorrt_llm" / "config.pbtxt")
    assert target.backend == "tensorrtllm" and target.max_batch_size == 4 and not target.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in target.parameters.items()}
    assert params["gpt_model_path"] == str(engine.resolve()) and params["enable_kv_cache_reuse"] == "true"
    assert params["gpt_model_type"] == "inflight_fused_batching" and params["exclude_input_in_output"] == "true"
    inputs = {i.name: i for i in target.input}
    assert {"input_ids", "input_lengths", "request_output_len", "draft_input_ids", "end_id", "pad_id"} <= set(inputs)
    assert inputs["draft_input_ids"].optional and list(inputs["request_output_len"].reshape.shape) == []
    assert {o.name for o in target.output} == {"output_ids", "sequence_length"}
    assert (repo / "tensorrt_llm" / "1").is_dir()
    bls = _model_config(repo / "retrospec_spec_bls" / "config.pbtxt")
    bls_params = {k: v.string_value for k, v in bls.parameters.items()}
    assert (bls_params["max_draft_len"], bls_params["max_seq_len"], bls_params["end_id"]) == ("6", "1024", "2")
    assert bls_params["draft_budget"] == "12" and bls_params["tensorrtllm_model_name"] == "tensorrt_llm"
    assert bls.instance_group[0].count == 4  # one BLS instance per engine batch slot
    draft = _model_config(repo / "retrospec_draft" / "config.pbtxt")
    serving = json.loads({k: v.string_value for k, v in draft.parameters.items()}["serving_config"])
    assert serving["datastores"] == [str(datastore.resolve())]
    for name in ("retrospec_spec_bls", "retrospec_draft"):
        model = repo / name / "1" / "model.py"
        py_compile.compile(str(model), doraise=True)
        assert str(model) in printed


def test_export_tensorrtllm_needs_an_end_id(tmp_path, capsys):
    engine = _engine_folder(tmp_path / "engine")
    (engine / BUILD_INFO_FILE).unlink()
    with pytest.raises(SystemExit):
        cli_main(["export-triton-repo", "--tensorrtllm", str(tmp_path / "repo"), "--engine-dir", str(engine)])
    assert "--end-id" in capsys.readouterr().err


# ---- on a GPU with TensorRT-LLM ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (it needs Linux + an NVIDIA GPU)")
    if not is_complete(default_model_dir()):
        pytest.skip("default model not prepared")
    from trt_engines.trtllm_build import run_build

    # max_num_tokens below the longest prompt of the lossless test, so the executor must chunk that context
    plan = plan_build(default_model_dir(), tmp_path_factory.mktemp("trtllm") / "engine", max_draft_len=8,
                      dtype="float32", max_batch_size=4, max_seq_len=512, max_num_tokens=128)
    run_build(plan)
    return plan.engine_dir


@pytest.mark.gpu
def test_gpu_engine_build_writes_commands_versions_and_a_speculative_engine(tiny_engine):
    info = json.loads((tiny_engine / BUILD_INFO_FILE).read_text())
    assert info["status"] == "built" and info["versions"]["tensorrt_llm"].startswith("1.")
    assert read_engine_config(tiny_engine).max_draft_len == 8


@pytest.mark.gpu
def test_gpu_tensorrtllm_engine_is_lossless_against_torch_engine(tiny_engine):
    import torch

    from orchestrator.spec_loop import generate
    from trt_engines.torch_engine import TorchEngine

    long_prompt = (PROMPT * 20)[:200]  # above the engine's max_num_tokens (128): a chunked context
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], PROMPT, long_prompt]
    reference, _ = generate(TorchEngine("default", dtype=torch.float32, max_context=512), prompts, max_new_tokens=24)
    draft_fn = _input_drafter(8)
    with TensorRTLLMEngine(tiny_engine) as engine:
        plain, _ = generate(engine, prompts, max_new_tokens=24, id_prefix="plain")
        spec, stats = generate(engine, prompts, max_new_tokens=24, draft_fn=draft_fn, id_prefix="spec")
    assert spec == plain  # losslessness on TensorRT-LLM itself: speculation changes nothing
    assert plain == reference  # and TensorRT-LLM's greedy output equals the reference engine's (fp32 both)
    assert sum(s.drafted for s in stats) > 0


@pytest.mark.gpu
def test_gpu_drafter_hook_in_tensorrt_llm_scheduler_is_lossless():
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed (it needs Linux + an NVIDIA GPU)")
    if not is_complete(default_model_dir()):
        pytest.skip("default model not prepared")
    from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams as TrtllmSampling
    from tensorrt_llm.llmapi import KvCacheConfig

    from drafter.trtllm_drafter import user_provided_config

    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], PROMPT]
    planner = LinearDraftPlanner(Drafter(DrafterConfig(sources="input")), max_draft_len=4, draft_cap=8)
    # as TensorRT-LLM's own user-provided-drafter test: overlap scheduler off, no KV block reuse, no CUDA graphs
    common = {"model": str(default_model_dir()), "max_batch_size": 2, "disable_overlap_scheduler": True,
              "cuda_graph_config": None, "kv_cache_config": KvCacheConfig(enable_block_reuse=False)}
    spec_llm = LLM(**common, speculative_config=user_provided_config(planner))
    spec = [r.outputs[0].token_ids for r in spec_llm.generate(prompts, TrtllmSampling(max_tokens=24))]
    spec_llm.shutdown()
    ref_llm = LLM(**common)
    ref = [r.outputs[0].token_ids for r in ref_llm.generate(prompts, TrtllmSampling(max_tokens=24))]
    ref_llm.shutdown()
    assert spec == ref and planner.steps > 0
