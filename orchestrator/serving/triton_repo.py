"""`retrospec export-triton-repo DIR`: a model repository for a stock tritonserver (Python backend).

Layout written:

    DIR/retrospec_generate/config.pbtxt    decoupled, inputs/outputs as in `triton_server` (same wire contract)
    DIR/retrospec_generate/1/model.py      builds a `ServingStack` from the config's `serving_config` parameter
    DIR/retrospec_draft/config.pbtxt
    DIR/retrospec_draft/1/model.py         a `DraftService` over the configured datastores

Both model.py files import retrospec: the `python_path` parameter lists this checkout and the site-packages of
the Python that exported the repository, so the backend stub (the same Python minor version) finds them. Start:

    LD_LIBRARY_PATH=$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))') \
        tritonserver --model-repository DIR
"""

from __future__ import annotations

import dataclasses
import json
import site
import sysconfig
from pathlib import Path
from types import SimpleNamespace

from orchestrator.serving.stack import HARDWARE_MODES, ServingConfig, open_datastores

TEMPLATES = Path(__file__).parent / "templates"
ROOT = Path(__file__).resolve().parents[2]

# The generate model's wire contract, for both servers (`triton_server` binds pytriton's tensors from it):
# (name, Triton type, dims, optional)
GENERATE_INPUTS = [
    ("text_input", "TYPE_STRING", "1", True), ("input_ids", "TYPE_INT32", "-1", True),
    ("max_tokens", "TYPE_INT32", "1", True), ("temperature", "TYPE_FP32", "1", True),
    ("top_p", "TYPE_FP32", "1", True), ("top_k", "TYPE_INT32", "1", True), ("seed", "TYPE_INT64", "1", True),
    ("stop", "TYPE_STRING", "-1", True), ("tpot_ms", "TYPE_FP32", "1", True), ("ignore_eos", "TYPE_BOOL", "1", True),
    ("cache_salt", "TYPE_STRING", "1", True), ("logprobs", "TYPE_INT32", "1", True),
    ("stream", "TYPE_BOOL", "1", True),
]
# (name, Triton type, dims); the last three only in the responses of a request that sent `logprobs`
GENERATE_OUTPUTS = [
    ("output_ids", "TYPE_INT32", "-1"), ("text_output", "TYPE_STRING", "1"), ("finish_reason", "TYPE_STRING", "1"),
    ("steps", "TYPE_INT32", "1"), ("accepted_tokens", "TYPE_INT32", "1"), ("tokens_per_step", "TYPE_FP32", "1"),
    ("output_log_probs", "TYPE_FP32", "-1"), ("top_logprob_ids", "TYPE_INT32", "-1, -1"),
    ("top_logprobs", "TYPE_FP32", "-1, -1"),
]
DRAFT_INPUTS = [
    ("request_id", "TYPE_STRING", "1", False), ("input_ids", "TYPE_INT32", "-1", True),
    ("budget", "TYPE_INT32", "1", True), ("end", "TYPE_BOOL", "1", True),
]
DRAFT_OUTPUTS = [
    ("draft_tokens", "TYPE_INT32", "-1"), ("draft_parents", "TYPE_INT32", "-1"),
    ("draft_probs", "TYPE_FP32", "-1"), ("best_path", "TYPE_INT32", "-1"),
]


def backend_request(pb_utils, request, inputs) -> SimpleNamespace:
    """A stock-tritonserver request as the pytriton models take it (`data`: input name -> array, the inputs it
    carries of `inputs`, a list above), so that both servers run one input check (`GenerateModel.stack_request`,
    `DraftModel.respond`). `pb_utils` is the backend's module, importable only inside tritonserver."""
    tensors = {name: pb_utils.get_input_tensor_by_name(request, name) for name, *_ in inputs}
    return SimpleNamespace(data={name: t.as_numpy() for name, t in tensors.items() if t is not None})


def error_response(pb_utils, exc: Exception):
    """The response for a request a stock-tritonserver model refuses: its message, INVALID_ARG (HTTP 400) for bad
    input (a ValueError), as the pytriton models answer (`templates/pytriton_cancel_model.py`)."""
    code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, ValueError) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code))


def render_config(name: str, inputs, outputs, *, decoupled: bool, parameters: dict[str, str]) -> str:
    lines = [f'name: "{name}"', 'backend: "python"', "max_batch_size: 0"]
    if decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines.append("input [")
    lines.append(",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]{" optional: true" if o else ""} }}'
                            for n, t, d, o in inputs))
    lines.append("]")
    lines.append("output [")
    lines.append(",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in outputs))
    lines.append("]")
    lines.append("instance_group [ { count: 1 kind: KIND_CPU } ]")
    for key, value in parameters.items():  # json.dumps gives a quoted, escaped string that protobuf text accepts
        lines.append(f"parameters {{ key: \"{key}\" value: {{ string_value: {json.dumps(value)} }} }}")
    return "\n".join(lines) + "\n"


def checked_for_the_server(config: ServingConfig, *, model: bool = True) -> ServingConfig:
    """`config` as tritonserver's model processes will read it: its paths (datastores, a model folder, a hardware
    profile) made absolute, since the server may start in another working directory, and each checked now, so that
    a wrong one is refused at export (`DatastoreError`, `FileNotFoundError`) rather than when the server loads the
    model. `model=False`: the model is not checked (the TensorRT-LLM repository's target is its engine)."""
    from trt_engines.prepare import resolve_model_dir

    absolute = {}
    if config.datastores is not None:
        absolute["datastores"] = tuple(str(Path(p).expanduser().resolve()) for p in config.datastores)
    if config.hardware not in HARDWARE_MODES and Path(config.hardware).is_file():
        absolute["hardware"] = str(Path(config.hardware).resolve())
    config = dataclasses.replace(config, **absolute)
    open_datastores(config)
    if model:
        folder = resolve_model_dir(config.model)
        if config.model != "default":
            config = dataclasses.replace(config, model=str(folder.resolve()))
    return config


def export_repository(directory: str | Path, config: ServingConfig = ServingConfig()) -> list[Path]:
    """Write the repository; returns the files written. `config`'s paths must exist here (`checked_for_the_server`)."""
    config = checked_for_the_server(config)
    directory = Path(directory)
    paths = [str(ROOT), *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    params = {"serving_config": json.dumps(dataclasses.asdict(config)),
              "python_path": json.dumps(list(dict.fromkeys(paths)))}
    written = []
    for name, template, inputs, outputs, decoupled in (
        ("retrospec_generate", "generate_model.py", GENERATE_INPUTS, GENERATE_OUTPUTS, True),
        ("retrospec_draft", "draft_model.py", DRAFT_INPUTS, DRAFT_OUTPUTS, False),
    ):
        (directory / name / "1").mkdir(parents=True, exist_ok=True)
        config_path = directory / name / "config.pbtxt"
        config_path.write_text(render_config(name, inputs, outputs, decoupled=decoupled, parameters=params))
        model_path = directory / name / "1" / "model.py"
        model_path.write_text((TEMPLATES / template).read_text())
        written += [config_path, model_path]
    return written


def bundled_tritonserver(workdir: str | Path, repository: str | Path, *, http_port: int, grpc_port: int,
                         metrics_port: int, address: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """The command line and environment to run pytriton's bundled tritonserver as a stock server on `repository`.

    pytriton ships one Python backend stub per Python version; like pytriton itself, this copies the bundle into
    `workdir` with the stub of the running Python in `backends/python`, and puts libpython's folder and the bundle's
    libraries on LD_LIBRARY_PATH."""
    import os
    import shutil
    import sys

    from pytriton.utils.distribution import get_libs_path, get_root_module_path, get_stub_path

    dist = Path(get_root_module_path()) / "tritonserver"
    target = Path(workdir) / "tritonserver"
    if not target.exists():
        shutil.copytree(dist, target, ignore=shutil.ignore_patterns("python_backend_stubs", "triton_python_backend_stub"))
        shutil.copy(get_stub_path(f"{sys.version_info[0]}.{sys.version_info[1]}"),
                    target / "backends" / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(get_libs_path()), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    argv = [str(target / "bin" / "tritonserver"), f"--model-repository={repository}",
            f"--backend-directory={target / 'backends'}", f"--http-address={address}", f"--http-port={http_port}",
            f"--grpc-address={address}", f"--grpc-port={grpc_port}", f"--metrics-address={address}",
            f"--metrics-port={metrics_port}", "--exit-timeout-secs=10"]
    return argv, env


# ---- `export-triton-repo --tensorrtllm`: TensorRT-LLM's Triton backend as the target ----------------------------
#
#     DIR/tensorrt_llm/config.pbtxt          backend "tensorrtllm", rendered from the engine folder's config.json
#     DIR/tensorrt_llm/1/                    (empty: the engine is read from gpt_model_path)
#     DIR/retrospec_draft/config.pbtxt + 1/model.py        as in the plain export
#     DIR/retrospec_spec_bls/config.pbtxt + 1/model.py     BLS: drafts with retrospec_draft, verifies with
#                                                          tensorrt_llm through `draft_input_ids`
#
# The tensorrtllm model's tensors and parameters follow NVIDIA's template (read, not copied; NVIDIA/TensorRT-LLM
# triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt, 1.x), trimmed to what the BLS sends:
# batch-dimensioned inputs with `reshape: { shape: [ ] }` for scalars, outputs output_ids [beam, tokens] and
# sequence_length [beam], parameters gpt_model_type / gpt_model_path / enable_kv_cache_reuse / ... as strings.

# (name, Triton type, dims, optional, scalar: reshape to [] in the backend)
TENSORRTLLM_INPUTS = [
    ("input_ids", "TYPE_INT32", "-1", False, False), ("input_lengths", "TYPE_INT32", "1", False, True),
    ("request_output_len", "TYPE_INT32", "1", False, True), ("draft_input_ids", "TYPE_INT32", "-1", True, False),
    ("end_id", "TYPE_INT32", "1", True, True), ("pad_id", "TYPE_INT32", "1", True, True),
    ("exclude_input_in_output", "TYPE_BOOL", "1", True, True), ("streaming", "TYPE_BOOL", "1", True, True),
]
TENSORRTLLM_OUTPUTS = [("output_ids", "TYPE_INT32", "-1, -1"), ("sequence_length", "TYPE_INT32", "-1")]
SPEC_BLS_INPUTS = [("input_ids", "TYPE_INT32", "-1", False), ("max_tokens", "TYPE_INT32", "1", True)]
SPEC_BLS_OUTPUTS = [("output_ids", "TYPE_INT32", "-1"), ("steps", "TYPE_INT32", "1"),
                    ("accepted_tokens", "TYPE_INT32", "1"), ("draft_tokens", "TYPE_INT32", "1")]


def render_tensorrtllm_config(engine, *, name: str = "tensorrt_llm", kv_cache_free_gpu_mem_fraction: float = 0.9,
                              max_queue_delay_us: int = 0, batch_scheduler_policy: str = "guaranteed_no_evict") -> str:
    """config.pbtxt of the `tensorrtllm` backend model for an `EngineConfig` (trt_engines.trtllm_build)."""
    if not 0 < kv_cache_free_gpu_mem_fraction <= 1:
        raise ValueError(f"kv_cache_free_gpu_mem_fraction must lie in (0, 1]; got {kv_cache_free_gpu_mem_fraction}")
    if batch_scheduler_policy not in ("guaranteed_no_evict", "max_utilization"):
        raise ValueError(f"batch_scheduler_policy must be guaranteed_no_evict or max_utilization; got "
                         f"{batch_scheduler_policy!r}")
    lines = [f'name: "{name}"', 'backend: "tensorrtllm"', f"max_batch_size: {engine.max_batch_size}",
             "model_transaction_policy { decoupled: false }",
             (f"dynamic_batching {{ preferred_batch_size: [ {engine.max_batch_size} ] "
              f"max_queue_delay_microseconds: {max_queue_delay_us} }}"), "input ["]
    lines.append(",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]{" reshape: { shape: [ ] }" if s else ""}'
        f'{" allow_ragged_batch: true" if d == "-1" else ""}{" optional: true" if o else ""} }}'
        for n, t, d, o, s in TENSORRTLLM_INPUTS))
    lines += ["]", "output ["]
    lines.append(",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in TENSORRTLLM_OUTPUTS))
    lines += ["]", "instance_group [ { count: 1 kind: KIND_CPU } ]"]
    params = {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": engine.engine_dir, "max_beam_width": "1",
        "batch_scheduler_policy": batch_scheduler_policy, "enable_kv_cache_reuse": "true",
        "kv_cache_free_gpu_mem_fraction": str(kv_cache_free_gpu_mem_fraction), "exclude_input_in_output": "true",
        "max_attention_window_size": str(engine.max_seq_len), "enable_chunked_context": "false",
        "normalize_log_probs": "true", "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    }
    for key, value in params.items():
        lines.append(f"parameters {{ key: \"{key}\" value: {{ string_value: {json.dumps(value)} }} }}")
    return "\n".join(lines) + "\n"


def export_tensorrtllm_repository(directory: str | Path, engine_dir: str | Path,
                                  config: ServingConfig | None = None, *, draft_budget: int = 16,
                                  tensorrtllm_model_name: str = "tensorrt_llm", end_id: int | None = None,
                                  pad_id: int | None = None, kv_cache_free_gpu_mem_fraction: float = 0.9,
                                  max_queue_delay_us: int = 0, batch_scheduler_policy: str = "guaranteed_no_evict",
                                  bls_instances: int | None = None) -> list[Path]:
    """Write the TensorRT-LLM pairing (see the layout above); returns the files written.

    A Python model instance serves one request at a time; `bls_instances` (default: the engine's max_batch_size) BLS
    instances let that many requests run at once, so the tensorrtllm model can batch their steps in flight."""
    from trt_engines.trtllm_build import read_engine_config

    config = checked_for_the_server(config or ServingConfig(hardware="nominal", fit_step_model=False), model=False)
    engine = read_engine_config(engine_dir)
    end_id = end_id if end_id is not None else (engine.eos_token_ids[0] if engine.eos_token_ids else None)
    if end_id is None:
        raise ValueError(f"{engine_dir} has no build_info.json with the model's eos_token_id: pass --end-id")
    pad_id = pad_id if pad_id is not None else (engine.pad_token_id if engine.pad_token_id is not None else end_id)
    bls_instances = engine.max_batch_size if bls_instances is None else bls_instances
    if bls_instances < 1:
        raise ValueError(f"bls_instances must be >= 1; got {bls_instances}")
    if not 1 <= draft_budget <= config.max_nodes_per_request:
        raise ValueError(f"draft_budget must lie in [1, {config.max_nodes_per_request}]; got {draft_budget}")
    directory = Path(directory)
    paths = [str(ROOT), *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    python_path = json.dumps(list(dict.fromkeys(paths)))
    written = []
    (directory / tensorrtllm_model_name / "1").mkdir(parents=True, exist_ok=True)
    target = directory / tensorrtllm_model_name / "config.pbtxt"
    target.write_text(render_tensorrtllm_config(
        engine, name=tensorrtllm_model_name, kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
        max_queue_delay_us=max_queue_delay_us, batch_scheduler_policy=batch_scheduler_policy))
    written.append(target)
    draft_params = {"serving_config": json.dumps(dataclasses.asdict(config)), "python_path": python_path}
    bls_params = {"python_path": python_path, "tensorrtllm_model_name": tensorrtllm_model_name,
                  "draft_model_name": "retrospec_draft", "max_draft_len": str(engine.max_draft_len),
                  "draft_budget": str(draft_budget), "max_seq_len": str(engine.max_seq_len), "end_id": str(end_id),
                  "pad_id": str(pad_id)}
    for name, template, inputs, outputs, params in (
        ("retrospec_draft", "draft_model.py", DRAFT_INPUTS, DRAFT_OUTPUTS, draft_params),
        ("retrospec_spec_bls", "spec_bls_model.py", SPEC_BLS_INPUTS, SPEC_BLS_OUTPUTS, bls_params),
    ):
        (directory / name / "1").mkdir(parents=True, exist_ok=True)
        config_path = directory / name / "config.pbtxt"
        text = render_config(name, inputs, outputs, decoupled=False, parameters=params)
        if name == "retrospec_spec_bls":
            text = text.replace("instance_group [ { count: 1 ", f"instance_group [ {{ count: {bls_instances} ")
        config_path.write_text(text)
        model_path = directory / name / "1" / "model.py"
        model_path.write_text((TEMPLATES / template).read_text())
        written += [config_path, model_path]
    return written


def export_tensorrtllm_main(argv) -> int:
    """`retrospec export-triton-repo --tensorrtllm DIR --engine-dir ENGINE` (flag stripped by orchestrator/cli.py)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="retrospec export-triton-repo --tensorrtllm",
        description="Write a Triton model repository pairing TensorRT-LLM's backend (the target) with "
                    "retrospec_draft through a BLS model (retrospec_spec_bls). Run it in NVIDIA's "
                    "tritonserver:<yy.mm>-trtllm-python-py3 container; see docs/tensorrt_llm.md.")
    parser.add_argument("dir", help="output folder (created; existing model folders are overwritten)")
    parser.add_argument("--engine-dir", required=True, help="a `retrospec build-engine` engine folder")
    parser.add_argument("--datastore", action="append", default=None, help="datastore folder for retrospec_draft "
                        "(repeatable; default: the default datastore if built)")
    parser.add_argument("--draft-budget", type=int, default=16, help="tree nodes drafted per step (default 16)")
    parser.add_argument("--tensorrtllm-model-name", default="tensorrt_llm")
    parser.add_argument("--end-id", type=int, default=None, help="default: the model's eos id from build_info.json")
    parser.add_argument("--pad-id", type=int, default=None, help="default: the model's pad id, else the end id")
    parser.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    parser.add_argument("--max-queue-delay-us", type=int, default=0)
    parser.add_argument("--batch-scheduler-policy", default="guaranteed_no_evict",
                        choices=("guaranteed_no_evict", "max_utilization"))
    parser.add_argument("--bls-instances", type=int, default=None,
                        help="concurrent requests of retrospec_spec_bls (default: the engine's max_batch_size)")
    args = parser.parse_args(argv)
    try:
        config = ServingConfig(datastores=None if args.datastore is None else tuple(args.datastore),
                               hardware="nominal", fit_step_model=False)
        written = export_tensorrtllm_repository(
            args.dir, args.engine_dir, config, draft_budget=args.draft_budget,
            tensorrtllm_model_name=args.tensorrtllm_model_name, end_id=args.end_id, pad_id=args.pad_id,
            kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
            max_queue_delay_us=args.max_queue_delay_us, batch_scheduler_policy=args.batch_scheduler_policy,
            bls_instances=args.bls_instances)
    except (ValueError, FileNotFoundError) as exc:  # DatastoreError is a ValueError
        parser.error(str(exc))
    for path in written:
        print(path)
    return 0
