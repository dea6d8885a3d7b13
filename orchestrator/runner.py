"""A background thread that owns an `Orchestrator` and steps it while there is work, for concurrent front ends.

Only the runner thread touches the orchestrator; `submit` and `cancel` from any thread (or event loop) are queued
as commands and applied between steps. Outputs come back through callbacks (run on the runner thread), through
`stream()` (an async iterator for asyncio servers), or through `generate()` (blocking).

    runner = OrchestratorRunner(orchestrator).start()
    async for out in runner.stream(GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=16)):
        print(out.token_ids, out.text)
    runner.shutdown()

Given a factory instead of an orchestrator, the runner thread builds it (engine, drafter, start-up profiling) before
its first step, and `call(fn)` runs any other work on it, so that one thread runs every parallel kernel of the
process. numba's and PyTorch's OpenMP runtimes (libgomp) keep a pool of worker threads for each thread that has
started a parallel region, and once one runtime manages more threads than there are CPUs its workers stop spinning
between regions and sleep instead. A verify step runs hundreds of short regions: on a 2-core AVX2 EPYC a plain decode
step of the default model took 49.9 ms on a second thread after the main thread had decoded, against 16.7 ms on
the main thread alone and 20.0 ms built and stepped on one other thread (`benchmarks/results/thread_pools.md`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from orchestrator.core import Orchestrator, OutputCallback
from orchestrator.request import FinishReason, GenerationRequest, RequestOutput, TokenLogprob


@dataclass
class Completion:
    """A finished request, gathered from its stream."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stats: object = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, where the request's sampling asks for them


class OrchestratorRunner:
    def __init__(self, orchestrator: Orchestrator | Callable[[], Orchestrator], *, idle_wait_s: float = 0.05) -> None:
        """`orchestrator`: one to step, or a factory that `start` calls on the runner thread (module docstring)."""
        self._factory = None if isinstance(orchestrator, Orchestrator) else orchestrator
        self.orchestrator: Orchestrator | None = None if self._factory else orchestrator
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel_on_stop = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ids = 0
        self.error: BaseException | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self) -> "OrchestratorRunner":
        """Start the runner thread; with a factory, return once it has built the orchestrator (its error, if it
        failed: the thread is gone then)."""
        if self._thread is None:
            built = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(built,), name="retrospec-orchestrator",
                                            daemon=True)
            self._thread.start()
            built.wait()
            if self.orchestrator is None:
                self._thread.join()
                raise self.error
        return self

    def shutdown(self, *, cancel_inflight: bool = False, timeout: float | None = 60.0) -> None:
        """Stop taking work; finish (or cancel) what is in flight, then stop the thread."""
        self._cancel_on_stop = cancel_inflight
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- client API (any thread) ---------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_output: OutputCallback, *, request_id: str | None = None) -> str:
        if self._stop.is_set():
            raise RuntimeError("the server is shutting down; no new requests are accepted")
        with self._lock:
            self._ids += 1
            request_id = request_id or f"req-{self._ids}"
        done = threading.Event()
        holder: list[BaseException] = []
        self._commands.put(("submit", request, on_output, request_id, done, holder))
        self._wake.set()
        self._wait_for(done)
        if holder:
            raise holder[0]
        return request_id

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> object:
        """fn() on the runner thread, between steps; returns its result or raises its error. For work that runs
        parallel kernels (module docstring), such as building another drafter."""
        if threading.current_thread() is self._thread:
            return fn()
        if not self.alive:
            raise RuntimeError("the runner is not running")
        done = threading.Event()
        holder: list = []
        self._commands.put(("call", fn, done, holder))
        self._wake.set()
        self._wait_for(done)
        kind, value = holder[0]
        if kind == "error":
            raise value
        return value

    def _wait_for(self, done: threading.Event) -> None:
        """Wait until the runner thread has applied a command; raise if the thread stopped before it did."""
        while not done.wait(0.5):
            if not self.alive and not done.is_set():
                raise RuntimeError(f"the runner stopped before it took the command ({self.error!r})"
                                   if self.error else "the runner stopped before it took the command")

    async def stream(self, request: GenerationRequest, *, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = await loop.run_in_executor(
            None, lambda: self.submit(request, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
                                      request_id=request_id)
        )
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.cancel(rid)  # the consumer went away mid-stream: free its KV blocks

    def generate(self, request: GenerationRequest, *, timeout: float | None = None) -> Completion:
        """Blocking: submit and wait for the whole completion."""
        finished = threading.Event()
        completion = Completion(request_id="")

        def collect(out: RequestOutput) -> None:
            completion.token_ids += out.token_ids
            completion.text += out.text
            if out.logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + out.logprobs
            if out.finished:
                completion.finish_reason, completion.stats, completion.error = out.finish_reason, out.stats, out.error
                finished.set()

        completion.request_id = self.submit(request, collect)
        if not finished.wait(timeout):
            self.cancel(completion.request_id)
            raise TimeoutError(f"request {completion.request_id} did not finish within {timeout} s")
        return completion

    # -- runner thread ----------------------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "submit":
                _, request, on_output, request_id, done, holder = command
                try:
                    self.orchestrator.submit(request, on_output, request_id=request_id)
                except Exception as exc:  # validation errors go back to the caller
                    holder.append(exc)
                done.set()
            elif command[0] == "call":
                _, fn, done, holder = command
                try:
                    holder.append(("result", fn()))
                except Exception as exc:  # the caller's error, not the runner's
                    holder.append(("error", exc))
                done.set()
            else:
                self.orchestrator.cancel(command[1])

    def _run(self, built: threading.Event) -> None:
        try:
            if self._factory is not None:
                self.orchestrator = self._factory()
        except BaseException as exc:  # raised by `start` on the caller's thread
            self.error = exc
            return
        finally:
            built.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                self._apply_commands()
                if self._stop.is_set() and self._cancel_on_stop:
                    for request_id in self.orchestrator.request_ids():
                        self.orchestrator.cancel(request_id)
                if self.orchestrator.idle:
                    if self._stop.is_set():
                        return
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                self.orchestrator.step()
        except BaseException as exc:  # surface engine crashes to every waiting client instead of hanging them
            self.error = exc
            for request_id in self.orchestrator.request_ids():
                try:
                    self.orchestrator.cancel(request_id)
                except Exception:
                    pass
            raise
        finally:
            self.orchestrator.close()
