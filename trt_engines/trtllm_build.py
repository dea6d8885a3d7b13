"""`retrospec build-engine`: a Hugging Face Llama-family checkpoint -> a TensorRT-LLM engine ready for speculation.

Two commands, both written verbatim into the engine folder (`build_commands.sh`) with the versions they ran under
(`build_info.json`):

    1. convert   HF folder -> TensorRT-LLM checkpoint (`<engine>/checkpoint/`): NVIDIA's
                 `examples/models/core/llama/convert_checkpoint.py` when `--convert-script` names it, otherwise
                 `python -m trt_engines.trtllm_build convert-checkpoint ...`, which makes the same two library calls
                 that script makes (`LLaMAForCausalLM.from_hugging_face` + `save_checkpoint`), so no TensorRT-LLM
                 source checkout is needed next to the wheel.
    2. build     trtllm-build --checkpoint_dir <engine>/checkpoint --output_dir <engine> --gemm_plugin <dtype>
                     --kv_cache_type paged --use_paged_context_fmha enable
                     --speculative_decoding_mode draft_tokens_external --max_draft_len N
                     --max_batch_size B --max_input_len I --max_seq_len S [--max_num_tokens T]

Why these flags: `draft_tokens_external` + `max_draft_len` let every request carry up to N externally proposed
draft tokens (`ExternalDraftTokensConfig`); paged KV + paged context FMHA are what KV-cache *block reuse* needs,
and block reuse is what makes re-submitting a request's whole sequence every step cheap (only the tokens past the
last full cached block are recomputed). `max_input_len` defaults to `max_seq_len - 1` for the same reason: each
verification step is a request whose input is the whole sequence so far. Block reuse itself is a runtime switch
(`KvCacheConfig(enable_block_reuse=True)` in `TensorRTLLMEngine`, `enable_kv_cache_reuse` in Triton).

Checked against (read, not copied; TensorRT-LLM's public source on GitHub, NVIDIA/TensorRT-LLM):
    - tensorrt_llm/commands/build.py (`trtllm-build` argument names: --checkpoint_dir, --output_dir,
      --max_batch_size, --max_input_len, --max_seq_len, --max_num_tokens, --kv_cache_type {continuous,paged,
      disabled}, --speculative_decoding_mode {draft_tokens_external,...}, --max_draft_len; plugin flags
      --gemm_plugin, --use_paged_context_fmha from tensorrt_llm/plugin add_plugin_argument)
    - examples/models/core/llama/convert_checkpoint.py (--model_dir, --output_dir, --dtype {auto,float16,
      bfloat16,float32}, --tp_size; `LLaMAForCausalLM.from_hugging_face(model_dir, dtype, mapping=...)`,
      `save_checkpoint(output_dir, save_config=(rank == 0))`)
    - examples/draft_target_model/README.md (the target-engine recipe for draft_tokens_external)
    - tensorrt_llm/builder.py (`BuildConfig` fields that `config.json` carries: max_batch_size, max_input_len,
      max_seq_len, max_num_tokens, max_draft_len, speculative_decoding_mode, plugin_config) and
      tensorrt_llm/models/modeling_utils.py (`SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL` == 2)
  The index that served these files holds mixed versions of the 1.x line; the flags above are the same across the
  1.0-1.3 files read. Nothing here has run against an installed TensorRT-LLM (see docs/tensorrt_llm.md).

Example (on a machine with an NVIDIA GPU and TensorRT-LLM 1.2.x):

    retrospec build-engine --model default --engine-dir engines/smollm2 --max-batch-size 8 --max-seq-len 2048
    retrospec build-engine --model default --engine-dir /tmp/e --dry-run   # writes the plan, runs nothing
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

PINNED_TRTLLM = "1.2"  # the release line these commands and the runtime calls were written against
BUILD_COMMANDS_FILE = "build_commands.sh"
BUILD_INFO_FILE = "build_info.json"
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
DTYPES = ("float16", "bfloat16", "float32")
DRAFT_TOKENS_EXTERNAL = 2  # tensorrt_llm.models.modeling_utils.SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL
REPO_ROOT = Path(__file__).resolve().parents[1]

INSTALL_HINT = (
    f"install TensorRT-LLM {PINNED_TRTLLM}.x on a Linux host with an NVIDIA GPU (`pip install "
    f"'tensorrt_llm=={PINNED_TRTLLM}.*'` after the CUDA and torch prerequisites of TensorRT-LLM's Linux installation "
    "guide), or run inside NVIDIA's container nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3; see "
    "docs/tensorrt_llm.md"
)


class TensorRTLLMUnavailable(RuntimeError):
    """TensorRT-LLM (the Python package or the `trtllm-build` command) is not installed here."""


class GPUUnavailable(RuntimeError):
    """No NVIDIA GPU is visible (`nvidia-smi` missing or listing no GPU)."""


# ---- the plan: pure, testable command assembly -----------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """Everything `build-engine` will run, decided before anything runs."""

    model_dir: Path
    engine_dir: Path
    max_draft_len: int
    dtype: str = "bfloat16"
    tp_size: int = 1
    max_batch_size: int = 8
    max_seq_len: int = 2048
    max_input_len: int = 2047
    max_num_tokens: int | None = None
    convert_script: Path | None = None
    python: str = sys.executable
    trtllm_build: str = "trtllm-build"

    @property
    def checkpoint_dir(self) -> Path:
        return self.engine_dir / "checkpoint"

    def convert_command(self) -> list[str]:
        if self.convert_script is not None:
            return [self.python, str(self.convert_script), "--model_dir", str(self.model_dir), "--output_dir",
                    str(self.checkpoint_dir), "--dtype", self.dtype, "--tp_size", str(self.tp_size)]
        return [self.python, "-m", "trt_engines.trtllm_build", "convert-checkpoint", "--model-dir", str(self.model_dir),
                "--output-dir", str(self.checkpoint_dir), "--dtype", self.dtype, "--tp-size", str(self.tp_size)]

    def build_command(self) -> list[str]:
        cmd = [self.trtllm_build, "--checkpoint_dir", str(self.checkpoint_dir), "--output_dir", str(self.engine_dir),
               "--gemm_plugin", self.dtype, "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable",
               "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(self.max_draft_len),
               "--max_batch_size", str(self.max_batch_size), "--max_input_len", str(self.max_input_len),
               "--max_seq_len", str(self.max_seq_len)]
        if self.max_num_tokens is not None:
            cmd += ["--max_num_tokens", str(self.max_num_tokens)]
        return cmd

    def commands(self) -> list[list[str]]:
        return [self.convert_command(), self.build_command()]

    def shell_script(self) -> str:
        """`build_commands.sh`: the exact argv of each command, shell-quoted, run from the repository root."""
        lines = ["#!/usr/bin/env bash", "# Written by `retrospec build-engine`: the exact commands it ran, in order.",
                 "set -euo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}"]
        lines += [shlex.join(cmd) for cmd in self.commands()]
        return "\n".join(lines) + "\n"


def plan_build(model_dir: str | os.PathLike, engine_dir: str | os.PathLike, *, max_draft_len: int,
               dtype: str = "bfloat16", tp_size: int = 1, max_batch_size: int = 8, max_seq_len: int = 2048,
               max_input_len: int | None = None, max_num_tokens: int | None = None,
               convert_script: str | os.PathLike | None = None, python: str = sys.executable) -> BuildPlan:
    """Validate the inputs and assemble the plan (raises ValueError naming the bad argument)."""
    model_dir, engine_dir = Path(model_dir).expanduser().resolve(), Path(engine_dir).expanduser().resolve()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    archs = json.loads(config_path.read_text()).get("architectures") or []
    if not any(a in LLAMA_FAMILY for a in archs):
        raise ValueError(f"{model_dir} is a {archs or 'model without `architectures`'}; build-engine converts "
                         f"Llama-family checkpoints ({', '.join(LLAMA_FAMILY)}) with TensorRT-LLM's LLaMA converter")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    for name, value in (("max_draft_len", max_draft_len), ("tp_size", tp_size), ("max_batch_size", max_batch_size),
                        ("max_seq_len", max_seq_len)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    max_input_len = max_seq_len - 1 if max_input_len is None else max_input_len
    if not 1 <= max_input_len < max_seq_len:
        raise ValueError(f"max_input_len must lie in [1, max_seq_len={max_seq_len}); got {max_input_len}. Each "
                         "verification step re-submits the whole sequence, so max_seq_len - 1 is the useful value")
    if max_draft_len >= max_seq_len:
        raise ValueError(f"max_draft_len {max_draft_len} must be below max_seq_len {max_seq_len}")
    if max_num_tokens is not None and max_num_tokens < max_batch_size * (max_draft_len + 1):
        raise ValueError(f"max_num_tokens {max_num_tokens} cannot hold one step of {max_batch_size} requests with "
                         f"{max_draft_len} draft tokens each ({max_batch_size * (max_draft_len + 1)} tokens)")
    script = None if convert_script is None else Path(convert_script).expanduser().resolve()
    if script is not None and not script.is_file():
        raise ValueError(f"--convert-script {script} does not exist (NVIDIA's examples/models/core/llama/"
                         "convert_checkpoint.py of the TensorRT-LLM release you installed)")
    if engine_dir == model_dir or model_dir in engine_dir.parents:
        raise ValueError("the engine folder must not be the model folder or inside it")
    return BuildPlan(model_dir=model_dir, engine_dir=engine_dir, max_draft_len=max_draft_len, dtype=dtype,
                     tp_size=tp_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                     max_input_len=max_input_len, max_num_tokens=max_num_tokens, convert_script=script, python=python)


# ---- environment checks and versions ---------------------------------------------------------------------------


def gpu_names() -> list[str]:
    """GPUs `nvidia-smi -L` lists; raises GPUUnavailable when the tool is missing or lists none."""
    if shutil.which("nvidia-smi") is None:
        raise GPUUnavailable("no NVIDIA GPU here: `nvidia-smi` is not on PATH. TensorRT-LLM builds engines for the "
                             "GPU they will run on; run build-engine on that machine (see docs/tensorrt_llm.md)")
    out = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    names = [line.strip() for line in (out.stdout or "").splitlines() if line.strip().startswith("GPU")]
    if out.returncode != 0 or not names:
        raise GPUUnavailable(f"`nvidia-smi -L` lists no GPU (exit {out.returncode}): {(out.stderr or '').strip()}")
    return names


def check_toolchain(plan: BuildPlan) -> None:
    """Raise TensorRTLLMUnavailable / GPUUnavailable with the fix, before anything runs."""
    if shutil.which(plan.trtllm_build) is None:
        raise TensorRTLLMUnavailable(f"`{plan.trtllm_build}` is not on PATH: {INSTALL_HINT}")
    probe = subprocess.run([plan.python, "-c", "import tensorrt_llm"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        tail = (probe.stderr or "").strip().splitlines()[-1:] or ["(no message)"]
        raise TensorRTLLMUnavailable(f"`{plan.python}` cannot import tensorrt_llm ({tail[0]}): {INSTALL_HINT}")
    gpu_names()


_VERSION_PROBE = """
import json, platform
from importlib import metadata
def dist(*names):
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None
print(json.dumps({"tensorrt_llm": dist("tensorrt_llm", "tensorrt-llm"), "tensorrt": dist("tensorrt"),
                  "torch": dist("torch"), "transformers": dist("transformers"), "python": platform.python_version(),
                  "platform": platform.platform()}))
"""


def versions(python: str = sys.executable) -> dict[str, object]:
    """Versions that decide what an engine is: TensorRT-LLM, TensorRT, torch (as `python` sees them), the GPUs and
    driver, and this checkout's commit."""
    probe = subprocess.run([python, "-c", _VERSION_PROBE], check=False, capture_output=True, text=True, timeout=120)
    info: dict[str, object] = json.loads(probe.stdout) if probe.returncode == 0 else {"probe_error": probe.stderr[-500:]}
    info["pinned_tensorrt_llm"] = f"{PINNED_TRTLLM}.x"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30)
        info["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    else:
        info["gpus"] = []
    git = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=False, capture_output=True, text=True)
    info["retrospec_commit"] = git.stdout.strip() if git.returncode == 0 else None
    return info


def model_token_ids(model_dir: Path) -> dict[str, object]:
    """eos / pad / bos ids of the HF model (config.json, then generation_config.json): the engine needs end_id."""
    ids: dict[str, object] = {}
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            for key in ("eos_token_id", "pad_token_id", "bos_token_id", "vocab_size"):
                if data.get(key) is not None:
                    ids[key] = data[key]
    return ids


# ---- running ---------------------------------------------------------------------------------------------------


def write_build_files(plan: BuildPlan, info: dict) -> tuple[Path, Path]:
    plan.engine_dir.mkdir(parents=True, exist_ok=True)
    script = plan.engine_dir / BUILD_COMMANDS_FILE
    script.write_text(plan.shell_script())
    script.chmod(0o755)
    info_path = plan.engine_dir / BUILD_INFO_FILE
    info_path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return script, info_path


def run_build(plan: BuildPlan, *, dry_run: bool = False) -> dict:
    """Run the plan (or, with `dry_run`, only write it); returns what `build_info.json` holds."""
    info: dict[str, object] = {
        "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(plan).items()},
        "commands": plan.commands(), "model_token_ids": model_token_ids(plan.model_dir), "dry_run": dry_run,
        "status": "planned" if dry_run else "running", "started_unix": time.time(),
    }
    if dry_run:
        info["versions"] = versions(plan.python)
        write_build_files(plan, info)
        return info
    check_toolchain(plan)
    info["versions"] = versions(plan.python)
    write_build_files(plan, info)  # the plan is on disk even if a command fails
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    steps = []
    for cmd in plan.commands():
        started = time.perf_counter()
        done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env)
        steps.append({"command": cmd, "returncode": done.returncode, "seconds": round(time.perf_counter() - started, 1)})
        if done.returncode != 0:
            info.update(status="failed", steps=steps)
            write_build_files(plan, info)
            raise RuntimeError(f"`{shlex.join(cmd)}` exited with {done.returncode}; the plan and versions are in "
                               f"{plan.engine_dir / BUILD_INFO_FILE}")
    info.update(status="built", steps=steps, engine=asdict(read_engine_config(plan.engine_dir)))
    write_build_files(plan, info)
    return info


def convert_checkpoint(model_dir: str, output_dir: str, dtype: str, tp_size: int = 1) -> None:
    """HF Llama folder -> TensorRT-LLM checkpoint, with the calls NVIDIA's convert_checkpoint.py makes (no
    quantization). Runs only where tensorrt_llm imports (`python -m trt_engines.trtllm_build convert-checkpoint`)."""
    try:
        from tensorrt_llm.mapping import Mapping
        from tensorrt_llm.models import LLaMAForCausalLM
    except ImportError as exc:
        raise TensorRTLLMUnavailable(f"cannot import tensorrt_llm ({exc}): {INSTALL_HINT}") from exc
    for rank in range(tp_size):
        mapping = Mapping(world_size=tp_size, rank=rank, tp_size=tp_size, pp_size=1)
        model = LLaMAForCausalLM.from_hugging_face(model_dir, dtype, mapping=mapping)
        model.save_checkpoint(output_dir, save_config=(rank == 0))
        del model


# ---- reading an engine folder ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """What the runtime and the Triton export need from `<engine>/config.json` (+ `build_info.json`)."""

    engine_dir: str
    architecture: str
    dtype: str
    vocab_size: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int | None
    max_draft_len: int
    tokens_per_block: int | None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    version: str | None = None
    extra: dict = field(default_factory=dict)


def read_engine_config(engine_dir: str | os.PathLike) -> EngineConfig:
    """Parse an engine folder; raises ValueError unless it is a draft_tokens_external engine with max_draft_len > 0."""
    engine_dir = Path(engine_dir)
    path = engine_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{engine_dir} is not a TensorRT-LLM engine folder (no config.json); build one with "
                         "`retrospec build-engine`")
    data = json.loads(path.read_text())
    pretrained, build = data.get("pretrained_config") or {}, data.get("build_config") or {}
    if not pretrained or not build:
        raise ValueError(f"{path} has no pretrained_config/build_config: not an engine written by trtllm-build")
    mode = build.get("speculative_decoding_mode")
    external = mode == DRAFT_TOKENS_EXTERNAL or (isinstance(mode, str) and "draft_tokens_external" in mode.lower())
    max_draft_len = int(build.get("max_draft_len") or 0)
    if not external or max_draft_len < 1:
        raise ValueError(f"{engine_dir} was built with speculative_decoding_mode={mode!r}, max_draft_len="
                         f"{max_draft_len}; rebuild with `retrospec build-engine` (draft_tokens_external, "
                         "max_draft_len >= 1)")
    eos: tuple[int, ...] = ()
    pad = None
    info_path = engine_dir / BUILD_INFO_FILE
    if info_path.is_file():
        ids = json.loads(info_path.read_text()).get("model_token_ids", {})
        raw = ids.get("eos_token_id")
        eos = tuple(int(t) for t in (raw if isinstance(raw, list) else [raw] if raw is not None else []))
        pad = ids.get("pad_token_id")
    plugin = build.get("plugin_config") or {}
    return EngineConfig(
        engine_dir=str(engine_dir.resolve()), architecture=str(pretrained.get("architecture", "")),
        dtype=str(pretrained.get("dtype", "")), vocab_size=int(pretrained["vocab_size"]),
        max_batch_size=int(build["max_batch_size"]), max_input_len=int(build["max_input_len"]),
        max_seq_len=int(build["max_seq_len"]),
        max_num_tokens=None if build.get("max_num_tokens") is None else int(build["max_num_tokens"]),
        max_draft_len=max_draft_len,
        tokens_per_block=None if plugin.get("tokens_per_block") is None else int(plugin["tokens_per_block"]),
        eos_token_ids=eos, pad_token_id=None if pad is None else int(pad), version=data.get("version"),
    )


# ---- command line ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, default_max_draft_len: int = 64) -> int:
    """`retrospec build-engine` (the orchestrator CLI passes the budget cap as `default_max_draft_len`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert-checkpoint"]:
        return _convert_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="retrospec build-engine",
        description="Convert a Hugging Face Llama-family checkpoint and build a TensorRT-LLM engine for speculation "
                    "(draft_tokens_external, paged KV with block reuse). Writes build_commands.sh and "
                    "build_info.json into the engine folder.")
    parser.add_argument("--model", default="default", help="HF model folder, or `default` (the prepared default model)")
    parser.add_argument("--engine-dir", required=True, help="output folder (the engine, its checkpoint/ and logs)")
    parser.add_argument("--max-draft-len", type=int, default=default_max_draft_len,
                        help=f"draft tokens per request and step (default: the budget cap, {default_max_draft_len})")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--max-input-len", type=int, default=None, help="default: max-seq-len - 1")
    parser.add_argument("--max-num-tokens", type=int, default=None)
    parser.add_argument("--convert-script", default=None,
                        help="NVIDIA's examples/models/core/llama/convert_checkpoint.py (default: the same calls "
                             "through `python -m trt_engines.trtllm_build convert-checkpoint`)")
    parser.add_argument("--python", default=sys.executable, help="the Python that has tensorrt_llm")
    parser.add_argument("--dry-run", action="store_true", help="write the plan and versions, run nothing")
    args = parser.parse_args(argv)
    from trt_engines.prepare import resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model)
        plan = plan_build(model_dir, args.engine_dir, max_draft_len=args.max_draft_len, dtype=args.dtype,
                          tp_size=args.tp_size, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                          max_input_len=args.max_input_len, max_num_tokens=args.max_num_tokens,
                          convert_script=args.convert_script, python=args.python)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    try:
        info = run_build(plan, dry_run=args.dry_run)
    except (TensorRTLLMUnavailable, GPUUnavailable, RuntimeError) as exc:
        print(f"retrospec build-engine: error: {exc}", file=sys.stderr)
        return 1
    print(plan.shell_script(), end="")
    print(f"# {info['status']}: {plan.engine_dir / BUILD_INFO_FILE}")
    return 0


def _convert_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trt_engines.trtllm_build convert-checkpoint")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.model_dir, args.output_dir, args.dtype, args.tp_size)
    except TensorRTLLMUnavailable as exc:
        print(f"convert-checkpoint: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
