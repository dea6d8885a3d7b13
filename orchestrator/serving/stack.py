"""The shared serving stack: one engine, one drafter, one orchestrator and one runner thread, used by every front
end (Triton models and the OpenAI-style HTTP API) in the process.

Vocabulary: a *front end* turns wire requests into `GenerationRequest`s and streams `RequestOutput`s back; the
*stack* owns everything behind that, including request validation shared by all front ends (`make_request`) and
the Prometheus metrics.

Example:

    stack = ServingStack.build(ServingConfig(policy="goodput", num_blocks=512))
    request = stack.make_request(text="def add(a, b):", max_tokens=16)
    completion = stack.runner.generate(request)
    stack.shutdown()
"""

from __future__ import annotations

import functools
import json
import threading
from contextlib import aclosing
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datastore.paths import default_datastore_dir
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator, OutputCallback, StepRecord, check_micro_batches, check_prefill_chunk
from orchestrator.request import GenerationRequest, RequestOutput
from orchestrator.roofline import HardwareSpec, ModelShape, StepTimeModel, check_row_table_rows, hardware
from orchestrator.runner import OrchestratorRunner
from orchestrator.serving.metrics import ServingMetrics
from trt_engines.base import InvalidField, SamplingParams, check_cpu_kernels

# A deliberately rough CPU roofline for when no profile is wanted (tests): the online refit corrects it.
NOMINAL_CPU = HardwareSpec("nominal-cpu", {"float32": 1e11, "bfloat16": 3e11}, mem_bandwidth=2e10, overhead_s=5e-3)


HARDWARE_MODES = ("measure", "nominal")  # `ServingConfig.hardware` values that name no device or profile


AUTO_PREFILL_CHUNK = 256


def serving_prefill_chunk(prefill_chunk: int | str | None, engine) -> int | None:
    """The orchestrator's `prefill_chunk` for a `ServingConfig.prefill_chunk`. "auto" chunks prompts by
    `AUTO_PREFILL_CHUNK` tokens where that is measured to pay and changes no bit: where the engine's chunks give bitwise
    a whole prefill's K/V and first token (`TorchEngine.exact_chunked_prefill`: its numba attention, bf16 on the CPU).
    There a prompt of 610-701 tokens arriving among 4 decoding requests stalled their streams for up to 1.3-1.6 s when
    prefilled whole and 0.62-0.66 s in 256-token chunks, at the same TTFT (1.01x) and throughput (1.02x)
    (`benchmarks/results/chunked_prefill.md`). Elsewhere (fp32; a GPU, not measured) prompts are prefilled whole."""
    if prefill_chunk != "auto":
        return prefill_chunk
    return AUTO_PREFILL_CHUNK if getattr(engine, "exact_chunked_prefill", False) else None


# The least value of each whole-number field of `ServingConfig`; `retrospec serve`'s flags refuse below these too,
# in the flag's own words (`orchestrator.serving.cli.int_at_least`).
INT_FLOORS = {"num_blocks": 1, "block_size": 1, "max_context": 2, "max_running": 1, "max_nodes_per_request": 1,
              "torch_threads": 1, "max_body_bytes": 1024}
_OPTIONAL_INTS = {"num_blocks", "max_context", "torch_threads"}  # None: the default (see the fields' comments)


@dataclass(frozen=True)
class ServingConfig:
    """Everything needed to build a stack. `datastores=None` means the default datastore if it is built (else the
    drafter uses the request's own input index only). `hardware`: "measure" profiles this device at start-up,
    "nominal" uses NOMINAL_CPU, anything else is a `roofline.hardware` name or profile JSON path."""

    model: str = "default"
    model_name: str = "retrospec"  # the name clients send (`model` in OpenAI requests)
    dtype: str = "bfloat16"
    device: str | None = None
    num_blocks: int | None = None
    block_size: int = 16
    max_context: int | None = 2048
    datastores: tuple[str, ...] | None = None
    policy: str = "goodput"
    max_nodes_per_request: int = 64
    max_running: int = 32
    hardware: str = "measure"
    fit_step_model: bool = True  # a few seconds of verify steps at start-up to fit this engine's constants
    # rows of a measured row table the fit prices rows by (`orchestrator.profiling.fit_step_model`); 0: roofline rows
    row_table_rows: int = 0
    torch_threads: int | None = None  # torch's CPU threads (TorchEngine's: None keeps the CPU's, 1 on a GPU)
    cpu_kernels: str = "auto"  # bf16 on the CPU: where TorchEngine runs its numba kernels (its `cpu_kernels`)
    prefix_caching: bool | None = None  # reuse earlier prompts' KV blocks (TorchEngine's; None: where exact)
    max_body_bytes: int = 1 << 20  # HTTP bodies above this are refused with 413
    draft_idle_timeout_s: float = 300.0  # retrospec_draft sessions without a call for this long are released
    draft_timeout_s: float | None = None  # a drafting call slower than this makes its step plain decoding
    micro_batches: int | None = None  # None: decide each step (`Orchestrator`); 1: never pipeline; 2+: always
    # prompt tokens a step may compute (chunked prefill); None: whole prompts; "auto": `AUTO_PREFILL_CHUNK`
    prefill_chunk: int | str | None = "auto"

    def __post_init__(self) -> None:
        BudgetPolicy.parse(self.policy)  # raises a clear ValueError on a typo
        if not self.model_name:
            raise ValueError("model_name must not be empty (clients send it as the OpenAI `model`)")
        for name, least in INT_FLOORS.items():
            value, optional = getattr(self, name), name in _OPTIONAL_INTS
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}{' (or None)' if optional else ''}; got {value!r}")
        check_row_table_rows(self.row_table_rows, "row_table_rows")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16; got {self.dtype!r}")
        check_cpu_kernels(self.cpu_kernels)
        if self.draft_idle_timeout_s <= 0:
            raise ValueError(f"draft_idle_timeout_s must be > 0; got {self.draft_idle_timeout_s}")
        if self.draft_timeout_s is not None and not self.draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s must be > 0 (or None: no timeout); got {self.draft_timeout_s}")
        check_micro_batches(self.micro_batches)
        if self.prefill_chunk != "auto":
            try:
                check_prefill_chunk(self.prefill_chunk)
            except ValueError:
                raise ValueError(f"prefill_chunk must be 'auto', an int >= 1 (prompt tokens per step) or None (whole "
                                 f"prompts); got {self.prefill_chunk!r}") from None
        if self.hardware not in HARDWARE_MODES:
            hardware(self.hardware)  # an unknown name or a bad profile is refused here, not after loading the model


class MeteredOrchestrator(Orchestrator):
    """An `Orchestrator` that reports every step to `ServingMetrics` (on the runner thread)."""

    def __init__(self, *args, metrics: ServingMetrics, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = metrics

    def step(self) -> StepRecord | None:
        record = super().step()
        if record is not None:
            self.metrics.observe_step(record)
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.free_kv_blocks.set(self.engine.free_blocks())
        return record


@dataclass
class ServingStack:
    config: ServingConfig
    engine: object
    drafter: object
    orchestrator: MeteredOrchestrator
    runner: OrchestratorRunner
    tokenizer: object  # tokenizers.Tokenizer
    metrics: ServingMetrics
    model_dir: Path
    _chat_tokenizer: object = field(default=None, repr=False)
    _chat_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- construction -----------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, config: ServingConfig = ServingConfig()) -> "ServingStack":
        import torch
        from tokenizers import Tokenizer

        from trt_engines.prepare import resolve_model_dir
        from trt_engines.torch_engine import TorchEngine

        metrics = ServingMetrics()
        model_dirs: list[Path] = []

        def build_orchestrator() -> MeteredOrchestrator:
            # On the runner thread, which runs every parallel kernel of the server (`orchestrator.runner` docstring),
            # from resolving the model folder to the step-model fit (start-up in one place; resolving runs no kernel).
            # The model folder and the datastores are found and opened first (file reads and mmaps): a wrong path
            # is refused in a moment, not after the model has loaded and its kernels compiled.
            if config.torch_threads:
                torch.set_num_threads(config.torch_threads)
            model_dir = Path(resolve_model_dir(config.model))
            model_dirs.append(model_dir)
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            datastores = open_datastores(config)
            engine = TorchEngine(model_dir, dtype=getattr(torch, config.dtype), device=config.device,
                                 num_blocks=config.num_blocks, block_size=config.block_size,
                                 max_context=config.max_context, cpu_kernels=config.cpu_kernels,
                                 prefix_caching=config.prefix_caching, torch_threads=config.torch_threads)
            if engine.device.type == "cpu":
                from trt_engines.sampling import compile_cpu_kernels

                compile_cpu_kernels()
            drafter = make_drafter(config, datastores)
            shape = ModelShape.from_config(model_dir)
            if config.hardware == "measure":
                from orchestrator.profiling import measure_hardware

                spec = measure_hardware(engine.device.type, stream_mb=128, repeats=3,
                                        cpu_kernels=getattr(engine, "kernel_linears", False), dtypes=(config.dtype,))
            elif config.hardware == "nominal":
                spec = NOMINAL_CPU
            else:
                spec = hardware(config.hardware)
            step_model = StepTimeModel.for_engine(engine, shape, spec, dtype=config.dtype)
            if config.fit_step_model:
                from orchestrator.profiling import fit_step_model

                fit_step_model(engine, step_model, repeats=1, table_rows=config.row_table_rows)
            policy = BudgetPolicy.parse(config.policy, max_nodes_per_request=config.max_nodes_per_request)
            return MeteredOrchestrator(engine, drafter, BudgetController(policy, step_model), tokenizer=tokenizer,
                                       max_running=config.max_running, metrics=metrics,
                                       draft_timeout_s=config.draft_timeout_s, micro_batches=config.micro_batches,
                                       prefill_chunk=serving_prefill_chunk(config.prefill_chunk, engine))

        runner = OrchestratorRunner(build_orchestrator).start()
        orchestrator = runner.orchestrator
        engine, drafter = orchestrator.engine, orchestrator.drafter
        metrics.free_kv_blocks.set(engine.free_blocks())
        return cls(config, engine, drafter, orchestrator, runner, orchestrator.tokenizer, metrics, model_dirs[0])

    def set_policy(self, text: str) -> None:
        """Switch the budget policy (benchmarks compare policies on one warm server). Call while idle."""
        policy = BudgetPolicy.parse(text, max_nodes_per_request=self.config.max_nodes_per_request)
        self.orchestrator.budget.policy = policy

    def clear_history(self) -> None:
        """Forget the drafter's output history (benchmarks that serve the same prompts again). Call while idle."""
        self.drafter.clear_history()

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prompt prefixes (benchmarks that serve the same prompts again). Call while
        idle."""
        self.engine.reset_prefix_cache()

    # -- request building (shared validation for every front end) ------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`): a byte-level BPE piece mapped back through its
        byte alphabet (one token may hold part of a UTF-8 character), else the token's decoded text."""
        alphabet = self._byte_alphabet
        piece = self.tokenizer.id_to_token(int(token_id))
        if alphabet is not None and piece is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        """Character -> byte of a byte-level BPE tokenizer's alphabet, None for other tokenizers."""
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character table

        return {char: byte for byte, char in bytes_to_unicode().items()}

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The model's chat template applied to OpenAI-style messages, with the assistant turn opened."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        turns = [{"role": _chat_role(m, i), "content": _chat_text(m, i)} for i, m in enumerate(messages)]
        with self._chat_lock:
            if self._chat_tokenizer is None:
                from transformers import AutoTokenizer

                self._chat_tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            return self._chat_tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)

    def make_request(
        self,
        *,
        text: str | None = None,
        prompt_ids: Sequence[int] | np.ndarray | None = None,
        max_tokens: int | None = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        tpot_s: float | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        logprobs: int | None = None,
    ) -> GenerationRequest:
        """Validate wire-level fields and build a request; the `InvalidField` (a ValueError) names the bad field and
        the fix. `max_tokens=None`: as many as the model's context holds after the prompt. `logprobs`: None, or how
        many of the most likely tokens to return beside each output token's own log probability."""
        if (text is None) == (prompt_ids is None):
            raise InvalidField("prompt", "send exactly one of a text prompt or prompt token ids")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidField("prompt", f"the prompt must be a string; got {type(text).__name__}")
            ids = self.encode(text)
        else:
            arr = np.asarray(prompt_ids)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InvalidField("prompt", "prompt token ids must be a flat list of integers")
            ids = [int(t) for t in arr]
        if not ids:
            raise InvalidField("prompt", "the prompt is empty: send at least one token (or non-empty text)")
        vocab = self.engine.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidField("prompt", f"prompt token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
                                       or max_tokens < 1):
            raise InvalidField("max_tokens", f"max_tokens must be an integer >= 1; got {max_tokens!r}")
        limit = self.engine.max_context - len(ids)
        if limit < 1:
            raise InvalidField("prompt", f"the prompt has {len(ids)} tokens; the model context is "
                                         f"{self.engine.max_context}: shorten the prompt")
        if max_tokens is None:
            max_tokens = limit
        if max_tokens > limit:
            raise InvalidField("max_tokens", f"max_tokens={max_tokens} is too large: prompt ({len(ids)} tokens) + "
                                             f"max_tokens must fit the context of {self.engine.max_context}; use "
                                             f"max_tokens <= {limit}")
        if isinstance(stop, str):
            stop = (stop,)
        # a dict or a set would iterate (keys, in no set order) and a number not at all
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidField("stop", f"stop must be a string or a list of strings; got {stop!r}")
        sampling = SamplingParams(temperature=_number(temperature, "temperature"), top_p=_number(top_p, "top_p"),
                                  top_k=_integer(top_k, "top_k"), seed=None if seed is None else _integer(seed, "seed"),
                                  logprobs=None if logprobs is None else _integer(logprobs, "logprobs"))
        return GenerationRequest(prompt_ids=tuple(ids), max_tokens=int(max_tokens), sampling=sampling,
                                 stop_strings=tuple(stop), ignore_eos=bool(ignore_eos),
                                 tpot_s=None if tpot_s is None else _number(tpot_s, "tpot_s"),
                                 cache_salt=cache_salt)

    # -- generation -------------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_output: OutputCallback, *, frontend: str,
               request_id: str | None = None) -> str:
        def observed(out: RequestOutput) -> None:
            self.metrics.observe_output(out, frontend=frontend)
            on_output(out)

        rid = self.runner.submit(request, observed, request_id=request_id)
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        return rid

    async def stream(self, request: GenerationRequest, *, frontend: str,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the loop early cancels the request (and frees its KV blocks).
        `request_id` names it for `runner.cancel` (default: the runner numbers it)."""
        first, finished = True, False
        try:
            # closing the runner's stream cancels an unfinished request
            async with aclosing(self.runner.stream(request, request_id=request_id)) as outputs:
                async for out in outputs:
                    if first:  # submitted (a rejected request raises before its first output)
                        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
                        first = False
                    finished = out.finished
                    self.metrics.observe_output(out, frontend=frontend)
                    yield out
        finally:
            if not first and not finished:  # the consumer left mid-stream; its final (cancelled) update went nowhere
                self.metrics.requests.labels(finish_reason="cancelled", frontend=frontend).inc()

    def shutdown(self, *, cancel_inflight: bool = False, timeout: float | None = 60.0) -> None:
        self.runner.shutdown(cancel_inflight=cancel_inflight, timeout=timeout)


def open_datastores(config: ServingConfig) -> list:
    """The configured datastores, opened (mmapped): `DatastoreError` names a missing or broken one."""
    from datastore import Datastore

    paths = config.datastores
    if paths is None:
        default = default_datastore_dir()
        paths = (str(default),) if (default / "manifest.json").is_file() else ()
    return [Datastore.open(p) for p in paths]


def make_drafter(config: ServingConfig, datastores: list | None = None):
    """A drafter over the configured datastores (`open_datastores`, unless given already open). Each call builds
    its own index state; the datastores' arrays are mmapped, so drafters share them."""
    from drafter.drafter import Drafter, DrafterConfig

    stores = open_datastores(config) if datastores is None else datastores
    return Drafter(DrafterConfig(sources="fused" if stores else "input"), datastores=stores)


def _chat_role(message, i: int) -> str:
    """A message's role for the chat template: OpenAI's `developer` (its newer name for instructions) is `system`."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string role and a content")
    role = message["role"]
    if role not in ("system", "developer", "user", "assistant"):
        raise ValueError(f"messages[{i}].role must be system, developer, user or assistant; got {role!r}")
    return "system" if role == "developer" else role


def _chat_text(message: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts, of which only text parts can be read here
    (joined by newlines, as vLLM joins them)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                                 f"...}}; got {kind!r} (this model reads text only)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a non-empty list of text parts; got {content!r}")


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidField(name, f"{name} must be a number; got {value!r}")
    return float(value)


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidField(name, f"{name} must be an integer; got {value!r}")
    return int(value)
