"""`retrospec serve` and `retrospec export-triton-repo` (registered in `orchestrator/cli.py`).

    retrospec serve --triton --http --triton-http-port 8000 --triton-grpc-port 8001 --http-port 9000
    retrospec export-triton-repo ./model_repository --policy goodput
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

from trt_engines.base import CPU_KERNEL_CHOICES, InvalidField


def _config_args(parser: argparse.ArgumentParser) -> None:
    from orchestrator.serving.stack import INT_FLOORS

    g = parser.add_argument_group("model and scheduling")
    g.add_argument("--model", default="default", help="model name or folder (default: the prepared default model)")
    g.add_argument("--model-name", type=model_name_arg, default="retrospec",
                   help="the model name clients send (OpenAI `model`)")
    g.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNEL_CHOICES,
                   help="bf16 on the CPU: numba kernels (batch-invariant on every tree branch) for linear layers and "
                   "attention, for attention only, or none; auto: attention where the CPU has AMX-BF16, numba "
                   "elsewhere")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse earlier requests' KV blocks for repeated prompt prefixes (default: on where the numba "
                   "kernels prefill, which makes reuse exact)")
    g.add_argument("--num-blocks", type=int_at_least(INT_FLOORS["num_blocks"]), default=None,
                   help="KV-cache blocks (default: 8 full contexts)")
    g.add_argument("--max-context", type=int_at_least(INT_FLOORS["max_context"]), default=2048)
    g.add_argument("--datastore", action="append", default=None,
                   help="datastore folder (repeatable; default: the default datastore if built)")
    g.add_argument("--policy", default="goodput", help="speculation budget: goodput, roofline, fixed:B or none")
    g.add_argument("--max-running", type=int_at_least(INT_FLOORS["max_running"]), default=32)
    g.add_argument("--hardware", default="measure", help="measure (profile at start-up), nominal, a known name "
                   "(H100-SXM, ...) or a profile JSON")
    g.add_argument("--no-fit", action="store_true", help="skip the start-up fit of the step-time model")
    g.add_argument("--row-table-rows", type=row_table_rows_arg, default=0,
                   help="price a step's rows by a table of 1..N rows measured at start-up (0: the roofline's; "
                        "for GEMM libraries whose cost steps in the rows, such as oneDNN's AMX kernels)")
    g.add_argument("--max-body-bytes", type=int_at_least(INT_FLOORS["max_body_bytes"]), default=1 << 20)
    g.add_argument("--draft-timeout-ms", type=draft_timeout_ms_arg, default=None,
                   help="a drafting call slower than this makes its step plain decoding (default: no timeout)")
    g.add_argument("--micro-batches", type=int_at_least(1), default=None,  # `check_micro_batches`'s least
                   help="split the running batch into this many micro-batches that take turns, one drafted while "
                   "another is verified (SPIN); 1: never (default: decide each step; never on a CPU-only machine)")
    g.add_argument("--prefill-chunk", type=prefill_chunk_arg, default="auto",
                   help="chunked prefill: prompt tokens a step may compute, so a long prompt is prefilled over several "
                   "steps while the running requests keep decoding; 0: whole prompts at admission (default: auto, "
                   "256 where chunks change no bit: bf16 on the CPU; whole prompts elsewhere)")


def int_at_least(least: int):
    """An argparse type: a whole number >= `least` (`stack.INT_FLOORS`), refused in the flag's own words (the
    config's checks would name its field instead)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return value

    return parse


def model_name_arg(text: str) -> str:
    """A --model-name argument: not empty (clients send it as the OpenAI `model`)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a name clients send as the OpenAI `model`, got ''")
    return text


def draft_timeout_ms_arg(text: str) -> float:
    """A --draft-timeout-ms argument: milliseconds > 0 (checked here, in the flag's unit, not as the config's
    seconds)."""
    try:
        ms = float(text)
    except ValueError:
        ms = float("nan")
    if not ms > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected milliseconds > 0 (leave it out for no timeout), got {text!r}")
    return ms


def row_table_rows_arg(text: str) -> int:
    """A --row-table-rows argument: 0 (the roofline prices rows) or a table of 2 or more rows
    (`orchestrator.roofline.check_row_table_rows`, which the config and the fit apply too)."""
    from orchestrator.roofline import check_row_table_rows

    try:
        return check_row_table_rows(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 (no row table) or a whole number of rows >= 2, "
                                         f"got {text!r}") from None


def prefill_chunk_arg(text: str) -> int | str | None:
    """A --prefill-chunk argument: "auto", 0 (whole prompts: None) or prompt tokens per step."""
    if text == "auto":
        return text
    try:
        tokens = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, 0 (whole prompts) or prompt tokens per step, got {text!r}")
    return tokens or None


def port_arg(text: str) -> int:
    """A port flag's argument: a TCP port, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {text!r}")
    return port


def check_ports(host: str, ports: dict[str, int]) -> str | None:
    """Why the front ends could not listen on these ports (flag -> port), or None. Asked before the model loads
    (a minute with profiling), rather than have uvicorn or tritonserver fail to bind after it."""
    flags_of: dict[int, list[str]] = {}
    for flag, port in ports.items():
        flags_of.setdefault(port, []).append(flag)
    for port, flags in flags_of.items():
        if len(flags) > 1:
            return f"{' and '.join(flags)} are both {port}: give each server its own port"
    for flag, port in ports.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: a listener blocks
                probe.bind(address)
        except OSError as exc:  # in use, an address not on this machine, a host name that does not resolve
            return (f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); pick a free port, or a "
                    "--host of this machine")
    return None


def in_flag_words(exc: Exception, args: argparse.Namespace) -> str:
    """`exc`'s message, where it names a config field (`InvalidField`) that one of these flags set, with the flag's
    name instead: the user typed --max-context, not max_context."""
    if isinstance(exc, InvalidField) and hasattr(args, exc.field):
        return str(exc).replace(exc.field, "--" + exc.field.replace("_", "-"))
    return str(exc)


def _config(args):
    from orchestrator.serving.stack import ServingConfig

    return ServingConfig(model=args.model, model_name=args.model_name, dtype=args.dtype, device=args.device,
                         cpu_kernels=args.cpu_kernels, prefix_caching=args.prefix_caching,
                         num_blocks=args.num_blocks, max_context=args.max_context,
                         datastores=None if args.datastore is None else tuple(args.datastore), policy=args.policy,
                         max_running=args.max_running, hardware=args.hardware, fit_step_model=not args.no_fit,
                         row_table_rows=args.row_table_rows,
                         max_body_bytes=args.max_body_bytes,
                         draft_timeout_s=None if args.draft_timeout_ms is None else args.draft_timeout_ms / 1e3,
                         micro_batches=args.micro_batches, prefill_chunk=args.prefill_chunk)


def serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrospec serve", description="Serve retrospec on 127.0.0.1 (by default).")
    parser.add_argument("--triton", action="store_true", help="start Triton Inference Server (pytriton)")
    parser.add_argument("--http", action="store_true", help="start the OpenAI-compatible HTTP API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=port_arg, default=9000, help="OpenAI API port")
    parser.add_argument("--triton-http-port", type=port_arg, default=8000)
    parser.add_argument("--triton-grpc-port", type=port_arg, default=8001)
    parser.add_argument("--triton-metrics-port", type=port_arg, default=8002)
    _config_args(parser)
    args = parser.parse_args(argv)
    if not (args.triton or args.http):
        parser.error("choose a front end: --triton, --http or both")
    from orchestrator.serving.stack import ServingStack

    try:
        config = _config(args)
    except ValueError as exc:
        parser.error(str(exc))
    ports = {"--http-port": args.http_port} if args.http else {}
    if args.triton:
        ports |= {"--triton-http-port": args.triton_http_port, "--triton-grpc-port": args.triton_grpc_port,
                  "--triton-metrics-port": args.triton_metrics_port}
    problem = check_ports(args.host, ports)
    if problem:
        parser.error(problem)
    steps = [f"loading {config.model} ({config.dtype})"]
    if config.hardware == "measure":
        steps.append("profiling this device")
    if config.fit_step_model:
        steps.append("fitting the step-time model")
    print(", ".join(steps) + " (a first run also compiles numba's kernels)...", flush=True)
    started = time.monotonic()
    try:
        stack = ServingStack.build(config)
    except (ValueError, FileNotFoundError) as exc:
        # a path that is not there (DatastoreError is a ValueError), or options the model or the hardware profile
        # cannot take (--max-context past the model's positions, a dtype the profile has no FLOP/s for): the
        # message names it and the fix
        print(f"retrospec serve: error: {in_flag_words(exc, args)}", file=sys.stderr, flush=True)
        return 2
    engine = stack.engine
    print(f"ready in {time.monotonic() - started:.0f} s: policy {config.policy}, {engine.total_blocks()} KV blocks "
          f"({engine.max_context}-token context), hardware {stack.orchestrator.budget.step_model.hardware.name}",
          flush=True)
    triton = None
    stop = threading.Event()
    try:
        if args.triton:
            from orchestrator.serving.triton_server import TritonPorts, start_triton

            triton = start_triton(stack, address=args.host, ports=TritonPorts(
                args.triton_http_port, args.triton_grpc_port, args.triton_metrics_port))
            print(f"triton: http {args.host}:{args.triton_http_port}, grpc {args.host}:{args.triton_grpc_port}",
                  flush=True)
        http = None
        if args.http:
            from orchestrator.serving.http_api import serve_http

            http = serve_http(stack, host=args.host, port=args.http_port, log_level="info")

        def on_signal(*_):  # first signal: graceful; uvicorn then waits for open responses to finish
            stop.set()
            if http is not None:
                http.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        if http is not None:
            print(f"openai api: http://{args.host}:{args.http_port}/v1", flush=True)
            http.run()
        else:
            while not stop.wait(0.5):
                pass
    finally:
        # Graceful: stop taking requests, let in-flight ones finish (bounded), then stop Triton.
        stack.shutdown(cancel_inflight=False, timeout=60)
        if triton is not None:
            triton.stop()
    return 0


def export_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrospec export-triton-repo",
                                     description="Write a Triton model repository (Python backend) for retrospec.")
    parser.add_argument("dir", help="output folder (created; existing model folders are overwritten)")
    _config_args(parser)
    args = parser.parse_args(argv)
    from orchestrator.serving.triton_repo import export_repository

    try:
        written = export_repository(args.dir, _config(args))
    except (ValueError, FileNotFoundError) as exc:  # a bad option, or a path that is not there (DatastoreError)
        parser.error(str(exc))
    for path in written:
        print(path)
    return 0
