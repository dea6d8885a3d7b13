"""The benchmark report (generated from results JSON) and the GPU verify-cost benchmark's CPU behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import attention_calls, gpu_orchestrator, gpu_sdpa_backends, gpu_verify_cost, report
from drafter.tree import DraftTree
from trt_engines.base import SamplingParams, VerifyItem
from trt_engines.llama import Transformer
from trt_engines.torch_engine import TorchEngine

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256, "eos_token_id": 0}


def test_headline_numbers_are_read_from_the_results(tmp_path):
    results = {"throughput": {"summary": {"speedup_goodput_c1_grounded": 2.345, "goodput_vs_none_min": 1.01,
                                          "goodput_vs_best_fixed_min": 0.99, "step_model_median_abs_err": 0.05,
                                          "identical_outputs_fraction": 1.0}},
               "throughput_avx2": {"machine": "x86_64 2 cores (AVX2, no bf16 dot-product instructions)",
                                   "rows": [{"cap": 16}, {"cap": 1}],
                                   "summary": {"speedup_goodput_c1_humaneval": 1.614,
                                               "speedup_goodput_c1_mtbench": 1.3983, "bf16_divergences": 0}},
               "simulator_validation": {"summary": {"sim_vs_measured_max_abs_err": 0.087}}}
    rows = report.headline_rows(results)
    table = report.headline_markdown(rows)
    assert "grounded 2.345" in table and "8.7%" in table and "| 1.010 |" in table
    partial = [r for r in rows if r[3] == "throughput_avx2"]
    # a speedup just under its goal (1.4) does not print as met
    assert partial[0][1] == "humaneval 1.614, mtbench 1.398"
    assert "(AVX2, no bf16" in partial[0][0] and "caps 1, 16)" in partial[0][0]
    assert ("| 0 |" in table) and any("differing" in r[0] for r in partial)

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nstale table\n{report.END}\nrest\n")
    assert report.update_readme(rows, readme)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{report.END}\nrest\n")
    assert "stale table" not in text and "grounded 2.345" in text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not report.update_readme(rows, plain) and plain.read_text() == "no markers\n"


def test_a_run_without_cap_1_or_the_fp32_check_has_no_rows_for_them():
    run = {"machine": "x86_64 2 cores", "rows": [{"cap": 4}, {"cap": 32}],
           "summary": {"goodput_vs_none_min": 0.9991, "goodput_vs_best_fixed_min": 1.02,
                       "step_model_median_abs_err": 0.03, "identical_outputs_fraction": None, "bf16_divergences": 0}}
    rows = report.headline_rows({"throughput_zen2_c4_32": run})
    assert [r[0].split(" (")[0] for r in rows] == [
        "goodput / none, min over caps and sets", "goodput / best fixed policy, min over caps and sets",
        "step-time model median relative error", "bf16 outputs differing from plain decoding, all speculating rows"]
    assert rows[0][1] == "0.999" and "caps 4, 32)" in rows[0][0]


def test_a_broken_results_file_is_named(tmp_path):
    (tmp_path / "throughput.json").write_text("{not json")
    with pytest.raises(ValueError, match="throughput.json"):
        report.load_results(tmp_path)


def test_plots_come_from_the_committed_results(tmp_path):
    results = report.load_results()
    assert results, "the repository commits its benchmark results"
    made = report.write_plots(results, tmp_path)
    assert made and all((tmp_path / name).stat().st_size > 1000 for name in made)


@pytest.mark.parametrize("benchmark, flags", [(gpu_verify_cost, []), (gpu_orchestrator, []), (gpu_sdpa_backends, []),
                                              (attention_calls, ["--device", "cuda"])],
                         ids=lambda m: m.__name__.split(".")[-1] if hasattr(m, "__name__") else "")
def test_a_gpu_benchmark_without_cuda_says_so_and_writes_nothing(benchmark, flags, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run for real")
    assert benchmark.main([*flags, "--out-dir", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_random_weight_model_runs_in_the_engine():
    model = Transformer.random(TINY, dtype=torch.float32)
    engine = TorchEngine(model, dtype=torch.float32, device="cpu", num_blocks=16, max_context=128)
    root = engine.add_request("r", [5, 6, 7], SamplingParams())
    out = engine.verify([VerifyItem("r", DraftTree.chain([1, 2, 3]))])
    assert 0 <= root < TINY["vocab_size"] and out.results[0].target_tokens.shape == (4,)
    again = Transformer.random(TINY, dtype=torch.float32)  # seeded: the same weights every time
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert json.dumps(gpu_verify_cost.datasheet_for("NVIDIA H100 80GB HBM3")) == '"H100-SXM"'
    assert gpu_verify_cost.datasheet_for("Tesla T4") is None
    assert np.isfinite(out.timings["total_ms"])


def test_step_time_model_for_an_engine_lays_attention_out_as_it_does():
    from orchestrator.roofline import KNOWN_HARDWARE, ModelShape, StepTimeModel

    engine = TorchEngine(Transformer.random(TINY, dtype=torch.float32), dtype=torch.float32, device="cpu",
                         num_blocks=16, max_context=128)
    engine.attention_call_cost = 1.0  # any price the engine plans with, the model plans with too
    model = StepTimeModel.for_engine(engine, ModelShape.from_config(TINY), KNOWN_HARDWARE["H100-SXM"], dtype="float32")
    assert (model.attention_layout, model.attention_call_cost, model.dtype) == ("grouped", 1.0, "float32")
    tokens, context = np.array([9.0, 1.0, 1.0]), np.full(3, 100.0)
    assert model.extra_attention_calls(tokens, context) == TINY["num_hidden_layers"]  # a call is cheap: split


def test_gpu_lossless_check_runs_on_cpu_too():
    # The same check the GPU benchmark runs first: transformers parity and speculative == plain greedy decoding.
    result = gpu_verify_cost.check_lossless("cpu", n_prompts=3, new_tokens=16)
    assert result["identical_outputs_fraction"] == 1.0
    assert result["max_abs_logit_diff_vs_transformers"] < 1e-4
    assert result["accepted_draft_tokens"] > 0  # the trees did carry the true continuation
    assert result["free_blocks_after"] == result["total_blocks"]


def test_gpu_orchestrator_reads_each_later_pass_against_the_first():
    def row(passed, policy, micro_batches, tokens_per_s):
        return {"cap": 16, "pass": passed, "policy": policy, "micro_batches": micro_batches,
                "tokens_per_s": tokens_per_s, "nodes_per_request_step": 0.1, "split_steps": 0, "steps": 100}

    rows = [row(1, "none", 1, 340.0), row(1, "fixed:4", 1, 200.0), row(1, "goodput", "per step", 280.0),
            row(2, "none", 1, 350.0), row(2, "fixed:4", 1, 360.0), row(2, "goodput", "per step", 336.0)]
    readings = " ".join(gpu_orchestrator.speed_readings(rows))
    assert ("Cap 16, pass 2, every shape met in pass 1 already: tokens/s `none` 1.03x, `fixed:4` 1.80x, "
            "`goodput` (micro-batches per step) 1.20x pass 1's.") in readings
    assert "pass 1, every shape" not in readings  # the first pass has nothing to be read against
    single = [{k: v for k, v in r.items() if k != "pass"} for r in rows[:3]]
    assert "every shape met" not in " ".join(gpu_orchestrator.speed_readings(single))
