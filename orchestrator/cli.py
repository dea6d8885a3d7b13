"""`retrospec` command line: one entry point with subcommands.

Subcommands register themselves in `COMMANDS`; each takes its own argv so a package's CLI also runs standalone
(`build-datastore ...` is `retrospec build-datastore ...`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _model(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrospec model", description="Manage target models.")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="convert the default model (SmolLM2-135M-Instruct GGUF) into the cache")
    prep.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    prep.add_argument("--verify", action="store_true", help="check file hashes, not just sizes")
    args = parser.parse_args(argv)
    from trt_engines.prepare import prepare_default_model

    prepare_default_model(force=args.force, verify=args.verify)
    return 0


def _build_datastore(argv: Sequence[str]) -> int:
    from datastore.cli import main as build_main

    return build_main(list(argv))


def _serve(argv: Sequence[str]) -> int:
    from orchestrator.serving.cli import serve_main

    return serve_main(list(argv))


def _export_triton_repo(argv: Sequence[str]) -> int:
    if "--tensorrtllm" in argv:  # TensorRT-LLM's Triton backend as the target (its own options: --engine-dir ...)
        from orchestrator.serving.triton_repo import export_tensorrtllm_main

        return export_tensorrtllm_main([a for a in argv if a != "--tensorrtllm"])
    from orchestrator.serving.cli import export_main

    return export_main(list(argv))


def _build_engine(argv: Sequence[str]) -> int:
    from orchestrator.budget import BudgetPolicy
    from trt_engines.trtllm_build import main as build_main

    # --max-draft-len defaults to the budget cap: the most nodes a request may ever send in one step.
    return build_main(list(argv), default_max_draft_len=BudgetPolicy().max_nodes_per_request)


def _simulate(argv: Sequence[str]) -> int:
    from tools.simulate import main as simulate_main

    return simulate_main(list(argv))


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "model": (_model, "prepare target models (`retrospec model prepare`)"),
    "build-datastore": (_build_datastore, "build a suffix-array datastore from corpora"),
    "serve": (_serve, "serve over Triton Inference Server (--triton) and/or an OpenAI-style HTTP API (--http)"),
    "export-triton-repo": (_export_triton_repo,
                           "write a model repository for a stock tritonserver (--tensorrtllm: with TensorRT-LLM)"),
    "build-engine": (_build_engine, "build a TensorRT-LLM engine for speculation from a HF Llama checkpoint (GPU)"),
    "simulate": (_simulate, "event-clock simulation of a deployment (model shape x device) on recorded trajectories"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: retrospec COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    handler, _ = COMMANDS[argv[0]]
    return handler(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
