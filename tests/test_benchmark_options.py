"""The long benchmarks refuse bad options when they start, before they load a model or measure anything: a run of
tens of minutes must not trip over them at its end."""

from __future__ import annotations

import pytest

from benchmarks import (cpu_attention, gpu_orchestrator, gpu_sdpa_backends, kv_placement, linear_rows,
                        one_call, prefill_attention, row_table, sampling, serving, throughput)


def refused_before_running(monkeypatch, owner, measuring: str, main, argv: list[str]) -> str:
    """The error `main(argv)` exits with (argparse's status 2, or a SystemExit message), where `owner.measuring`,
    the first step that measures, is a tripwire that fails the test if it is reached."""
    def tripwire(*args, **kwargs):
        raise AssertionError(f"{measuring} ran: the benchmark started measuring")

    monkeypatch.setattr(owner, measuring, tripwire)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    return str(exit_info.value.code)


@pytest.mark.parametrize("argv, message", [
    (["--caps", "1", "0"], "--caps must be >= 1; got 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1; got 0"),
    (["--rounds", "0"], "--rounds must be >= 1; got 0"),
    (["--identity-prompts", "-1"], "--identity-prompts must be >= 0; got -1"),
    (["--policies", "none", "fixed:0"], "--policies: policy 'fixed:0': `fixed:B` needs a whole number of nodes"),
    (["--name", "../elsewhere"], "--name '../elsewhere': a file name in benchmarks/results"),
    (["--prefill-chunk", "-8"], "--prefill-chunk: prefill_chunk must be an int >= 1 (prompt tokens per step)"),
    (["--prefill-chunk", "whole"], "expected auto, 0 (whole prompts) or prompt tokens per step, got 'whole'"),
    (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0 (0 = greedy); got -1.0"),
    (["--temperature", "nan"], "--temperature: temperature must be a finite number >= 0"),
    (["--temperature", "0.8", "--top-p", "0"], "--top-p: top_p must lie in (0, 1] (1 = no nucleus cut); got 0.0"),
    (["--top-p", "0.9"], "--top-p samples only with a --temperature above 0"),
    (["--row-table-rows", "1"], "--row-table-rows: expected 0 (no row table) or a whole number of rows >= 2"),
])
def test_throughput_refuses_bad_options_before_measuring(monkeypatch, capsys, argv, message):
    refused_before_running(monkeypatch, throughput, "run", throughput.main, argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--caps", "1", "0"], "--caps must be >= 1, --held-out >= 4 and --max-tokens >= 1"),
    (["--held-out", "2"], "--caps must be >= 1, --held-out >= 4 and --max-tokens >= 1"),
    (["--max-tokens", "0"], "--caps must be >= 1, --held-out >= 4 and --max-tokens >= 1"),
    (["--sets", "nope"], "invalid choice: 'nope'"),
    (["--name", "a/b"], "--name 'a/b': a file name in benchmarks/results"),
])
def test_row_table_refuses_bad_options_before_measuring(monkeypatch, capsys, argv, message):
    refused_before_running(monkeypatch, row_table, "run", row_table.main, argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rates", "0.5", "0", "--requests", "4", "4"], "--rates must be > 0 requests per second; got 0.0"),
    (["--rates", "0.5", "--requests", "0"], "--requests and --max-tokens must be >= 1; got 0 and 128"),
    (["--rates", "1", "--requests", "8", "--max-tokens", "0"], "--requests and --max-tokens must be >= 1; got 8 and 0"),
    (["--tpot-ms", "-5"], "--tpot-ms must be > 0; got -5.0"),
    (["--out", "/tmp/x"], "--out '/tmp/x': a file name in benchmarks/results"),
    (["--rates", "0.5"], "give one --requests count per rate"),
])
def test_serving_refuses_bad_options_before_starting_the_server(monkeypatch, capsys, argv, message):
    refused_before_running(monkeypatch, serving.ServingStack, "build", serving.main, argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("benchmark", [cpu_attention, kv_placement, linear_rows, one_call, prefill_attention,
                                       sampling])
def test_rounds_benchmarks_refuse_a_round_count_below_one_before_measuring(monkeypatch, capsys, benchmark):
    refused_before_running(monkeypatch, benchmark, "measure", benchmark.main, ["--rounds", "0"])
    assert "--rounds must be >= 1; got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--passes", "0"], "--passes must be >= 1; got 0"),
    (["--caps", "1", "8"], "--caps: each cap must be 1, 4 or 16 (the request counts are set for those); got (1, 8)"),
])
def test_gpu_orchestrator_refuses_bad_options_before_looking_for_a_gpu(monkeypatch, capsys, argv, message):
    refused_before_running(monkeypatch, gpu_orchestrator, "lossless", gpu_orchestrator.main, argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--caps", "1", "0"], "--caps and --max-tokens must be >= 1; got [1, 0] and 48"),
    (["--max-tokens", "0"], "--caps and --max-tokens must be >= 1; got [1, 16] and 0"),
])
def test_gpu_sdpa_backends_refuses_bad_options_before_starting_a_process(monkeypatch, capsys, argv, message):
    refused_before_running(monkeypatch, gpu_sdpa_backends, "measure", gpu_sdpa_backends.main, argv)
    assert message in capsys.readouterr().err
