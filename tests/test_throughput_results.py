"""`benchmarks/throughput.py --replace-groups`: re-measured (set, cap) groups replace the old ones in a results file,
everything else stays, and the file says what was replaced."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import results_files, throughput
from tests.test_benchmark_options import refused_before_running
from tools.trajectories import spread


def _row(set_name: str, cap: int, policy: str, tok_s: float) -> dict:
    return {"set": set_name, "cap": cap, "policy": policy, "tokens_per_s": tok_s, "speedup": 1.0, "prompts": 8}


def _results(rows: list[dict], outputs: dict[str, np.ndarray], tmp_path) -> None:
    groups = sorted({(r["set"], r["cap"]) for r in rows})
    old = {"rows": rows, "group_fits": [{"set": s, "cap": c, "fit": "old"} for s, c in groups],
           "bf16_divergences": [{"set": s, "cap": c, "policy": "goodput", "top2_logit_gap": 0.1} for s, c in groups],
           "step_model_median_abs_err": 0.08, "identity": {"identical_outputs_fraction": 1.0}, "max_tokens": 192,
           "outputs_file": "throughput_outputs.npz"}
    (tmp_path / "throughput.json").write_text(json.dumps(old))
    np.savez_compressed(tmp_path / "throughput_outputs.npz", **outputs)


def test_replaced_groups_swap_in_place_and_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "RESULTS", tmp_path)
    old_rows = [_row(s, c, p, v) for s, c in (("a", 1), ("a", 16), ("b", 1))
                for p, v in (("none", 10.0), ("fixed:4", 12.0), ("goodput", 11.0))]
    _results(old_rows, {f"{s}_{c}_{p}_tokens": np.array([c, 7]) for s, c in (("a", 1), ("a", 16), ("b", 1))
                        for p in ("none", "goodput")}, tmp_path)
    new = {"rows": [_row("a", 1, p, v) for p, v in (("none", 10.0), ("fixed:4", 12.0), ("goodput", 15.0))],
           "group_fits": [{"set": "a", "cap": 1, "fit": "new"}], "bf16_divergences": [],
           "outputs": {"a_1_goodput_tokens": np.array([9, 9, 9])}, "max_tokens": 192, "seconds": 3.0, "rounds": 3}

    merged = throughput.replace_groups("throughput", new, command="python -m benchmarks.throughput --caps 1",
                                       note="disturbed")

    assert [(r["set"], r["cap"]) for r in merged["rows"]] == [(r["set"], r["cap"]) for r in old_rows]
    assert [r["tokens_per_s"] for r in merged["rows"] if r["set"] == "a" and r["cap"] == 1] == [10.0, 12.0, 15.0]
    assert [g["fit"] for g in merged["group_fits"]] == ["new", "old", "old"]
    assert {(d["set"], d["cap"]) for d in merged["bf16_divergences"]} == {("a", 16), ("b", 1)}
    assert merged["summary"]["goodput_vs_best_fixed_min"] == pytest.approx(11.0 / 12.0)  # from the kept groups
    assert merged["replaced_groups"] == [{"groups": [["a", 1]], "command": "python -m benchmarks.throughput --caps 1",
                                          "rounds": 3, "seconds": 3.0, "note": "disturbed",
                                          "code_revision": results_files.code_revision()}]
    assert merged["code_revision"] is None  # the old file did not name its commit: not claimed to be this one
    with np.load(tmp_path / "throughput_outputs.npz") as arrays:
        assert sorted(arrays.files) == ["a_16_goodput_tokens", "a_16_none_tokens", "a_1_goodput_tokens",
                                        "b_1_goodput_tokens", "b_1_none_tokens"]
        np.testing.assert_array_equal(arrays["a_1_goodput_tokens"], [9, 9, 9])
        np.testing.assert_array_equal(arrays["a_16_none_tokens"], [16, 7])


def test_replacing_a_group_the_file_never_measured_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "RESULTS", tmp_path)
    _results([_row("a", 1, "none", 10.0)], {"a_1_none_tokens": np.array([1])}, tmp_path)
    before = (tmp_path / "throughput.json").read_text()
    new = {"rows": [_row("a", 4, "none", 10.0)], "group_fits": [], "bf16_divergences": [], "outputs": {},
           "max_tokens": 192, "seconds": 1.0}
    with pytest.raises(SystemExit, match="no rows for"):
        throughput.replace_groups("throughput", new, command="c", note=None)
    with pytest.raises(SystemExit, match="same --policies"):
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "goodput", 9.0)]}, command="c",
                                  note=None)
    with pytest.raises(SystemExit, match="max-tokens"):
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)], "max_tokens": 64},
                                  command="c", note=None)
    with pytest.raises(SystemExit, match="took its prompts another way"):  # the file's rows served the first n
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)],
                                                 "prompt_sample": "spread"}, command="c", note=None)
    with pytest.raises(SystemExit, match="interleaved its policies another way"):  # the file's rows took turns
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)],
                                                 "interleave": "progress"}, command="c", note=None)
    with pytest.raises(SystemExit, match="priced a step's rows by the roofline; pass --row-table-rows 0"):
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)],
                                                 "step_model": {"row_seconds": [0.0, 1e-3, 2e-3]}}, command="c",
                                  note=None)
    with pytest.raises(SystemExit, match="--prefill-chunk 0"):  # the file's rows prefilled whole prompts
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)],
                                                 "prefill_chunk": 256}, command="c", note=None)
    assert (tmp_path / "throughput.json").read_text() == before
    numba_file = json.dumps({**json.loads(before), "cpu_kernels": True})  # older files: a bool (True: "numba")
    (tmp_path / "throughput.json").write_text(numba_file)
    with pytest.raises(SystemExit, match="--cpu-kernels numba"):  # another engine would measure something else
        throughput.replace_groups("throughput", {**new, "rows": [_row("a", 1, "none", 9.0)],
                                                 "cpu_kernels": "attention"}, command="c", note=None)
    assert (tmp_path / "throughput.json").read_text() == numba_file


def test_the_recorded_command_leaves_the_note_out():
    assert (throughput.recorded_command(["--caps", "16", "--note", "load burst: see log", "--replace-groups"])
            == "python -m benchmarks.throughput --caps 16 --replace-groups")
    assert throughput.recorded_command(["--note=why", "--rounds", "3"]) == "python -m benchmarks.throughput --rounds 3"


def test_spread_sample_covers_the_whole_set():
    mtbench_like = [f"{category}-{i}" for category in "abcdefgh" for i in range(10)]  # sorted by category
    picked = spread(mtbench_like, 8)
    assert [p[0] for p in picked] == list("abcdefgh") and picked[0] == "a-0" and picked[-1] == "h-9"
    assert len(set(spread(mtbench_like, 64))) == 64  # never the same prompt twice
    assert spread(mtbench_like, 200) == mtbench_like and spread(mtbench_like, 0) == []


@pytest.mark.parametrize("policies", [["none", "goodput", "goodput"], ["fixed:4", "none", "fixed:4"]])
def test_a_policy_listed_twice_is_refused_before_anything_runs(policies, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(throughput, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as exited:
        throughput.main(["--policies", *policies, "--sets", "grounded", "--caps", "1"])
    assert exited.value.code == 2
    repeated = next(p for p in policies if policies.count(p) > 1)
    assert f"--policies lists {repeated} more than once" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_replacement_the_file_cannot_take_is_refused_before_measuring(tmp_path, monkeypatch):
    # --replace-groups checks the results file when it starts, not after tens of minutes of measuring
    monkeypatch.setattr(throughput, "RESULTS", tmp_path)
    prompts = len(spread(throughput.load_trajectories(throughput.trajectory_path("mtbench", "eval")), 16))
    rows = [{**_row("mtbench", 1, p, 10.0), "prompts": prompts} for p in throughput.POLICIES]
    _results(rows, {"mtbench_1_none_tokens": np.array([1])}, tmp_path)
    before = (tmp_path / "throughput.json").read_text()
    for argv, message in ((["--caps", "4"], "no rows for"), (["--caps", "1", "--max-tokens", "64"], "max-tokens"),
                          (["--caps", "1", "--policies", "none", "goodput"], "same --policies"),
                          (["--caps", "1", "--temperature", "0.8"], "sampled with greedy decoding")):
        refused = refused_before_running(monkeypatch, throughput, "run", throughput.main,
                                         ["--sets", "mtbench", "--replace-groups", *argv])
        assert message in refused
    assert (tmp_path / "throughput.json").read_text() == before


def test_a_results_file_names_the_commit_that_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(results_files, "RESULTS", tmp_path)
    head = subprocess.run(["git", "-C", str(Path(results_files.__file__).parents[1]), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")

    def markdown(path, result):
        path.write_text(f"rev {result['code_revision']}")

    results_files.save_results("r", {"x": 1}, markdown)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["x"] == 1 and saved["code_revision"].removesuffix("+dirty") == head.stdout.strip()
    assert (tmp_path / "r.md").read_text() == f"rev {saved['code_revision']}"
    results_files.save_results("s", {"code_revision": None}, markdown)  # a file that names its own stays as it is
    assert json.loads((tmp_path / "s.json").read_text())["code_revision"] is None
    # the benchmarks that write their JSON elsewhere (GPU ones to --out-dir) go through the same function
    written = results_files.write_results_json(tmp_path / "gpu.json", {"y": 2}, indent=1)
    assert json.loads((tmp_path / "gpu.json").read_text()) == written == {"y": 2, "code_revision": saved["code_revision"]}
