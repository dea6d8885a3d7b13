"""What a client submits and what it gets back, plus incremental detokenization with stop strings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from trt_engines.base import InvalidField, SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"  # the request failed (e.g. rejected by the engine); other requests go on


@dataclass(frozen=True)
class GenerationRequest:
    """A generation job. `prompt_ids` are token ids after chat-template rendering (the front ends do that)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    tpot_s: float | None = None  # time-per-output-token objective (seconds); None = no objective
    cache_salt: str | None = None  # prefix-cache namespace: requests with other salts never share cached KV blocks

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise InvalidField("prompt_ids", "the prompt is empty: send at least one token (or non-empty text)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidField("max_tokens", f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if self.tpot_s is not None and not (math.isfinite(self.tpot_s) and self.tpot_s > 0):
            raise InvalidField("tpot_s", f"tpot objective must be a positive number of seconds; got {self.tpot_s!r}")
        if any(not s for s in self.stop_strings):
            raise InvalidField("stop_strings", "stop strings must be non-empty")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidField("cache_salt",
                               f"cache_salt must be a non-empty string (or None); got {self.cache_salt!r}")


@dataclass
class RequestStats:
    steps: int = 0  # verification steps the request took part in
    drafted: int = 0  # draft nodes it sent
    accepted: int = 0  # draft tokens accepted
    fallbacks: int = 0  # steps where drafting failed and it decoded plainly
    cached_prompt_tokens: int = 0  # prompt tokens read from the engine's prefix cache instead of computed

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log probability under the model, and the most likely tokens' at its position, most likely
    first (as many as `SamplingParams.logprobs` asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob_list(token_ids, logprobs) -> list[TokenLogprob]:
    """`TokenLogprob`s of tokens from the engine's rows for them (`trt_engines.base.TokenLogprobs`, row i for
    token i)."""
    return [TokenLogprob(int(token), float(chosen), tuple(zip(ids.tolist(), values.tolist())))
            for token, chosen, ids, values in zip(token_ids, logprobs.chosen, logprobs.top_ids, logprobs.top_logprobs)]


@dataclass
class RequestOutput:
    """One streamed update: the tokens (and text) new since the last update; `finish_reason` set on the last one.
    `logprobs`: one per token of `token_ids`, where the request's sampling asks for them."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None  # on the final update
    error: str | None = None
    server_error: bool = False  # the failure was the server's (the engine refused it mid-generation), not the request's
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merged_output(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """A request's updates as one, for a client that asked for the whole output at once: every token, text delta
    and log probability in order, and the last update's finish reason, statistics and error."""
    if not outputs:
        raise ValueError("merged_output needs at least one update")
    logprobs = None if all(o.logprobs is None for o in outputs) else [e for o in outputs for e in o.logprobs or []]
    return replace(outputs[-1], token_ids=[t for o in outputs for t in o.token_ids],
                   text="".join(o.text for o in outputs), logprobs=logprobs)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas and finds stop strings.

    Decodes only a short window (from `prefix_offset`) each time, and holds back text that ends in an incomplete
    UTF-8 character or that could be the start of a stop string, so a stop string is never half-emitted.

    Stop strings are looked for after every token, as plain decoding adds them one by one, however many tokens a
    speculative step brings at once: the stop string and the token it ends in are the ones plain decoding would stop
    at, so the text and the tokens kept are plain decoding's (`add` says how many of a step's tokens that is). Where
    several stop strings complete in the same token, the text ends before the one that starts first.
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self._longest_stop = max((len(s) for s in stop_strings), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text decided so far (emitted or held back)
        self.emitted = 0  # characters of `text` already emitted

    def add(self, token_ids: list[int]) -> tuple[str, int | None]:
        """Append tokens; return the text delta to emit and, where a stop string was hit, how many of `token_ids`
        plain decoding would have kept: the stop string ends in the last of them (None: no stop string)."""
        for n, token in enumerate(token_ids, 1):
            self.ids.append(token)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            full = self.tokenizer.decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                searched = max(0, len(self.text) - self._longest_stop + 1)  # a stop string new text can complete
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                found = [at for at in (self.text.find(stop, searched) for stop in self.stop_strings) if at >= 0]
                if found:
                    self.text = self.text[: min(found)]
                    delta = self.text[self.emitted :]
                    self.emitted = len(self.text)
                    return delta, n
        hold = max((_partial_suffix(self.text, s) for s in self.stop_strings), default=0)
        end = len(self.text) - hold
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, None

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0

