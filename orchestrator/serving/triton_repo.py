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

from orchestrator.serving.stack import ServingConfig

TEMPLATES = Path(__file__).parent / "templates"
ROOT = Path(__file__).resolve().parents[2]

# (name, Triton type, dims, optional)
GENERATE_INPUTS = [
    ("text_input", "TYPE_STRING", "1", True), ("input_ids", "TYPE_INT32", "-1", True),
    ("max_tokens", "TYPE_INT32", "1", True), ("temperature", "TYPE_FP32", "1", True),
    ("top_p", "TYPE_FP32", "1", True), ("top_k", "TYPE_INT32", "1", True), ("seed", "TYPE_INT64", "1", True),
    ("stop", "TYPE_STRING", "-1", True), ("tpot_ms", "TYPE_FP32", "1", True), ("ignore_eos", "TYPE_BOOL", "1", True),
]
GENERATE_OUTPUTS = [
    ("output_ids", "TYPE_INT32", "-1"), ("text_output", "TYPE_STRING", "1"), ("finish_reason", "TYPE_STRING", "1"),
    ("steps", "TYPE_INT32", "1"), ("accepted_tokens", "TYPE_INT32", "1"), ("tokens_per_step", "TYPE_FP32", "1"),
]
DRAFT_INPUTS = [
    ("request_id", "TYPE_STRING", "1", False), ("input_ids", "TYPE_INT32", "-1", True),
    ("budget", "TYPE_INT32", "1", True), ("end", "TYPE_BOOL", "1", True),
]
DRAFT_OUTPUTS = [
    ("draft_tokens", "TYPE_INT32", "-1"), ("draft_parents", "TYPE_INT32", "-1"),
    ("draft_probs", "TYPE_FP32", "-1"), ("best_path", "TYPE_INT32", "-1"),
]


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


def export_repository(directory: str | Path, config: ServingConfig = ServingConfig()) -> list[Path]:
    """Write the repository; returns the files written."""
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
