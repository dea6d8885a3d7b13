"""Roofline step-time model: how long one verification step takes for a given batch composition.

A step processes, for every running request i, `tokens[i]` new tokens (the root + its draft-tree nodes, or a whole
prompt for a prefill) against `context[i]` cached tokens. Per decoder layer the operators are

    op            FLOPs                        bytes moved
    QKV proj      2 T h (hq + 2 hkv)           W + T (h + hq + 2 hkv)          (T = sum of tokens)
    O proj        2 T hq h                     W + T (hq + h)
    attention_i   4 t_i (c_i + t_i) hq         2 (c_i + t_i) hkv + 2 t_i hq    (per request: KV read + Q/O)
    MLP           2 T h f * 3                  W + T (2 h + 3 f)
  and once per step: LM head 2 T h V, bytes V h + T (h + V).

Each operator costs max(FLOPs / peak, bytes / bandwidth) (sizes times the dtype's bytes), summed per class into a
feature vector [1, linear, attention, lm_head, T, extra attention calls]. The last counts, on an engine that splits
a step's attention into several calls (`attention_layout="grouped"`), the calls beyond one per layer: each costs
host work no roofline sees (~140 us of PyTorch ops per call and layer on the CPU, 4 ms of a 60 ms step per extra
call; 0.13-0.18 ms per call and layer on an H100's host). The model splits a step as the engine would, at the
engine's price of a call (`attention_call_cost`, `trt_engines.attention_groups.call_cost_for`). The predicted
time is the feature vector's dot product with fitted coefficients; the defaults [overhead, 1, 1, 1, 0, 0] are the
pure roofline, and `fit`/`observe` refit them by least squares on measured steps (online, from the engine's
timings), which absorbs what the roofline leaves out (kernel efficiency, per-token framework costs, norms and RoPE).

A measured row table, where one is given (`row_seconds`, measured per engine at start-up by
`orchestrator.profiling.measure_row_seconds`, as Sequoia's hardware-aware tree optimizer measures its forward time per
tree size), replaces the linear, LM-head and token terms: some GEMM libraries price rows in steps, not along a
line. oneDNN's AMX kernels on a Xeon ran 1-16 rows at 0.88-1.17 plain steps, 17 rows at 1.60 and 33-41 rows cheaper
than 17-32 (`benchmarks/results/verify_rows_amx_oneoff.md`); a line through those costs prices 17 rows like 16 and
sends trees over the cliff.
The table's feature is the measured extra seconds of a step of T rows over one of one row (one request at a short
context), beyond the table at its upper half's slope; the fit still scales it (host speed moves between minutes).
Off by default: where the cost is close to a line (numba's kernels on a Zen 4 and a Zen 2 EPYC) the roofline did as
well (`benchmarks/results/row_table.md`, `row_table_avx2.md`).

In the linear operators b (requests) and s (tokens per request) appear only as T = b*s: below the ridge
T* = peak * dtype_bytes / (2 * bandwidth) they are memory-bound and extra tokens are nearly free. `free_budget()` is
that b*s (SSSD's free speculation budget).

Tensor parallelism divides weights, heads and FLOPs by `tp` and adds two all-reduces of T*h per layer over the
interconnect.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numba as nb
import numpy as np

from trt_engines.attention_groups import CALL_COST, plan_attention_groups

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class HardwareSpec:
    """Peak dense FLOP/s per dtype, memory bandwidth (bytes/s), interconnect bandwidth per GPU (bytes/s)."""

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    interconnect_bandwidth: float = 0.0
    overhead_s: float = 0.0  # fixed per-step cost (kernel launches, scheduling) before any fit

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r}: {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "HardwareSpec":
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not a hardware profile ({exc}); make one with `python -m tools.profile_hardware`") from exc


# Vendor datasheet figures, dense (no structured sparsity).
KNOWN_HARDWARE: dict[str, HardwareSpec] = {
    "H100-SXM": HardwareSpec("H100-SXM", {"bfloat16": 989e12, "float16": 989e12, "fp8": 1979e12, "float32": 67e12},
                             3.35e12, interconnect_bandwidth=450e9, overhead_s=2e-4),
    "H200": HardwareSpec("H200", {"bfloat16": 989e12, "float16": 989e12, "fp8": 1979e12, "float32": 67e12},
                         4.8e12, interconnect_bandwidth=450e9, overhead_s=2e-4),
    "A100-80GB": HardwareSpec("A100-80GB", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                              2.039e12, interconnect_bandwidth=300e9, overhead_s=2e-4),
    "L40S": HardwareSpec("L40S", {"bfloat16": 362e12, "float16": 362e12, "fp8": 733e12, "float32": 91.6e12},
                         864e9, interconnect_bandwidth=32e9, overhead_s=2e-4),
    "Ascend-910B4": HardwareSpec("Ascend-910B4", {"bfloat16": 280e12, "float16": 280e12}, 0.8e12,
                                 interconnect_bandwidth=56e9, overhead_s=3e-4),
}


def hardware(name_or_path: str) -> HardwareSpec:
    """A known device by name, or a measured profile JSON (tools/profile_hardware.py)."""
    if name_or_path in KNOWN_HARDWARE:
        return KNOWN_HARDWARE[name_or_path]
    if Path(name_or_path).is_file():
        return HardwareSpec.from_json(name_or_path)
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {', '.join(KNOWN_HARDWARE)} or a profile JSON path")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder that set its step cost."""

    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tp: int = 1

    def __post_init__(self) -> None:
        # Tensor parallelism splits the attention heads across GPUs (KV heads are replicated where fewer).
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1 or self.n_heads % self.tp:
            raise ValueError(f"the tensor-parallel degree must be a whole number >= 1 that divides the model's "
                             f"{self.n_heads} attention heads; got {self.tp!r}")

    @classmethod
    def from_config(cls, config: dict | str | Path, *, tp: int = 1) -> "ModelShape":
        if not isinstance(config, dict):
            path = Path(config)
            config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        n_heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads", n_heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            vocab=config["vocab_size"],
            tp=tp,
        )

    @property
    def n_params(self) -> int:
        h, hq, hkv = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = h * (hq + 2 * hkv) + hq * h + 3 * h * self.intermediate
        return self.n_layers * per_layer + self.vocab * h


FEATURES = ("overhead", "linear", "attention", "lm_head", "tokens", "attention_calls")
_ATTENTION_CALLS = FEATURES.index("attention_calls")
ATTENTION_LAYOUTS = ("packed", "grouped", "padded")
IRLS_PASSES = 6  # reweighted least-squares passes per fit (`StepTimeModel.fit_samples`); they settle within a few


@dataclass
class StepTimeModel:
    """Predicts step seconds from (tokens per request, context per request); refits itself from measurements."""

    shape: ModelShape
    hardware: HardwareSpec
    dtype: str = "bfloat16"
    coefficients: np.ndarray = field(default=None)  # type: ignore[assignment]
    window: int = 512  # measured steps kept for the online refit
    # How the engine lays out a batch's attention. "packed": each request attends over its own tokens and context
    # (paged/varlen kernels: TensorRT-LLM). "padded": one batched call in which every request computes as many
    # query rows as the largest tree and as many keys as the longest context (`TorchEngine`'s SDPA), so one deep
    # tree makes every request of the step pay for its depth. "grouped": a few such calls, each over requests of
    # similar shape (`trt_engines.attention_groups.plan_attention_groups`: `TorchEngine`).
    attention_layout: str = "packed"
    attention_call_cost: float = CALL_COST  # "grouped": the engine planner's price of a call (`TorchEngine`'s)
    # Measured extra seconds of a step of T rows over a step of one row, at T = 1..len (so row_seconds[0] == 0):
    # prices everything that grows with the step's rows in place of the roofline's linear, LM-head and token terms
    # (module docstring). None: the roofline's terms.
    row_seconds: np.ndarray | None = None
    _samples: deque = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"unknown attention layout {self.attention_layout!r}; use one of {ATTENTION_LAYOUTS}")
        if self.coefficients is None:
            self.coefficients = np.array([self.hardware.overhead_s, 1.0, 1.0, 1.0, 0.0, 0.0])
        self.coefficients = step_coefficients(self.coefficients)
        self._compute_rates()
        self._samples = deque(maxlen=self.window)
        self._anchors: list[tuple[np.ndarray, float]] = []  # the start-up calibration sweep (`fit`), kept for refits
        self._observed = 0
        self.set_row_seconds(self.row_seconds)

    # -- roofline terms (seconds), vectorised over the leading axis of their arguments ---------------------------
    # The budget controller prices a dozen candidate steps per step, so each operator's max(FLOPs / peak,
    # bytes / bandwidth) is kept as seconds per token and per byte-constant (`_rate_table`, from the table in the
    # module docstring) for the numba kernels below that price a step.
    def _compute_rates(self) -> None:
        s, e = self.shape, DTYPE_BYTES[self.dtype]
        peak, bw = self.hardware.flops(self.dtype), self.hardware.mem_bandwidth
        h, f, v = s.hidden, s.intermediate / s.tp, s.vocab / s.tp
        hq, hkv = s.n_heads * s.head_dim / s.tp, s.n_kv_heads * s.head_dim / s.tp
        # per linear operator: (FLOPs per token, weight bytes, activation bytes per token)
        ops = [(2 * h * (hq + 2 * hkv), e * h * (hq + 2 * hkv), e * (h + hq + 2 * hkv)),  # QKV projection
               (2 * hq * h, e * hq * h, e * (hq + h)),  # O projection
               (6 * h * f, e * 3 * h * f, e * (2 * h + 3 * f))]  # MLP
        linear_rates = [(flops / peak, weights / bw, per_token / bw) for flops, weights, per_token in ops]
        allreduce_s_per_token = (2 * (2 * (s.tp - 1) / s.tp) * h * e / self.hardware.interconnect_bandwidth
                                 if s.tp > 1 and self.hardware.interconnect_bandwidth > 0 else 0.0)
        lm_head_rates = (2 * h * v / peak, e * v * h / bw, e * (h + v) / bw)
        # attention, per layer: FLOPs 4 t (c + t) hq; bytes e (2 (c + t) hkv + 2 t hq)
        self._attention_rates = (4 * hq / peak, e * 2 * hkv / bw, e * 2 * hq / bw)
        # the kernels' rate table: 3 linear operators, the all-reduce (two of T x h per layer, TP), LM head, attention
        self._rate_table = np.array([*(r for rates in linear_rates for r in rates), allreduce_s_per_token,
                                     *lm_head_rates, *self._attention_rates], dtype=np.float64)

    def attention_seconds(self, tokens, context) -> np.ndarray:
        """Per request (elementwise over `tokens`, `context`), all layers."""
        t = np.asarray(tokens, dtype=np.float64)
        keys = t + np.asarray(context, dtype=np.float64)
        flops, per_key, per_row = self._attention_rates
        per_layer = np.maximum(flops * t * keys, per_key * keys + per_row * t)
        return np.where(t > 0, self.shape.n_layers * per_layer, 0.0)

    def batch_attention_seconds(self, tokens, context) -> float:
        """All requests of one step, in this engine's attention layout."""
        return self._attention_terms(tokens, context)[0]

    def extra_attention_calls(self, tokens, context) -> float:
        """Attention calls of one step beyond one per layer (only a "grouped" engine makes more than one)."""
        return self._attention_terms(tokens, context)[1]

    def _attention_terms(self, tokens, context) -> tuple[float, float]:
        t = np.ascontiguousarray(tokens, dtype=np.float64)
        c = np.ascontiguousarray(context, dtype=np.float64)
        one_call = self.attention_layout == "padded" or self.attention_layout == "grouped" and t.size == 1
        if one_call or self.attention_layout == "packed" or t.size == 0:  # no calls to plan: one kernel prices it
            return _batch_attention(self._rate_table, self.shape.n_layers, t, c, one_call), 0.0
        groups = plan_attention_groups(np.rint(t).astype(np.int64), np.rint(c + t).astype(np.int64),
                                       call_cost=self.attention_call_cost)
        # every request of a call: its deepest tree's query rows over its longest context's keys (one vectorised
        # pass over the calls: the budget controller prices a dozen candidate steps per step this way)
        sizes = np.array([g.size for g in groups])
        members = np.concatenate(groups)
        starts = np.cumsum(sizes) - sizes
        rows = np.maximum.reduceat(t[members], starts)
        keys = np.maximum.reduceat((c + t)[members], starts)
        return float(sizes @ self.attention_seconds(rows, keys - rows)), float(self.shape.n_layers * (len(groups) - 1))

    def features(self, tokens, context) -> np.ndarray:
        """The step's feature row [1, linear, attention, LM head, T, extra calls] (`FEATURES`), priced by the kernels
        `_prefix_features` uses: the budget controller and the online refit price two or three steps per step, and
        as array ops a row cost ~60 us (~100 us inside a served run, ~0.2 ms of each cap-1 CPU step)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.float64)
        attention_s, extra_calls = self._attention_terms(tokens, context)
        row = np.empty(len(FEATURES))
        _fill_features(self._rate_table, self._row_table, self.shape.n_layers, float(tokens.sum()), attention_s,
                       extra_calls, row)
        return row

    def prefix_seconds(self, context: np.ndarray, candidate_context: np.ndarray, candidate_rank: np.ndarray,
                       attention_calls: float) -> np.ndarray:
        """Seconds of one step of plain decoding (`context`: cached tokens per request) after adding its first k
        candidate tokens, for k = 0..n at once: candidate i is the `candidate_rank[i]`-th added to a request with
        `candidate_context[i]` cached tokens. Linear and LM-head terms depend on the total token count only, and
        each candidate changes one request's attention (its own rows and keys), so no prefix re-runs the model.
        "padded": every request pays for the deepest tree over the longest context. Otherwise each request is priced
        alone (packed), with `attention_calls` extra attention calls whatever is added (the budget controller
        prices grouping separately)."""
        return prefix_step_seconds(*self.prefix_pricing(), np.ascontiguousarray(context, dtype=np.float64),
                                    float(attention_calls), np.ascontiguousarray(candidate_context, dtype=np.float64),
                                    np.ascontiguousarray(candidate_rank, dtype=np.float64))

    def prefix_pricing(self) -> tuple[np.ndarray, np.ndarray, int, bool, np.ndarray]:
        """The model's own arguments of `prefix_step_seconds` (rate table, row table, layers, padded layout,
        coefficients), for a caller that prices the prefixes inside its own kernel (the budget controller's
        `_goodput_curve`)."""
        return (self._rate_table, self._row_table, self.shape.n_layers, self.attention_layout == "padded",
                self.coefficients)

    def plain_step(self, context) -> tuple[float, float]:
        """Predicted seconds of a plain decoding step (one token per request over `context`) and its attention calls
        beyond one per layer, from one feature row (the budget controller needs both on every step)."""
        row = self.features(np.ones(len(context)), context)
        return float(row @ self.coefficients), float(row[_ATTENTION_CALLS])

    def predict(self, tokens, context) -> float:
        """Predicted seconds for one step; `tokens[i]` new tokens of request i over `context[i]` cached ones."""
        return float(self.features(tokens, context) @ self.coefficients)

    def set_row_seconds(self, row_seconds) -> None:
        """Price rows by a measured table from now on (`row_seconds`; None: by the roofline's terms). The kept
        samples and start-up sweep were priced the other way, so they are dropped: set it before `fit`."""
        self._row_table = row_table(row_seconds)
        self.row_seconds = None if row_seconds is None else np.array(row_seconds, dtype=np.float64)
        self._samples.clear()
        self._anchors = []

    # -- fitting ----------------------------------------------------------------------------------------------
    def observe(self, tokens, context, measured_s: float, *, refit_every: int = 16) -> None:
        """Record a measured step; refit every `refit_every` observations once enough have been seen.

        Refits use the recent window plus the start-up calibration sweep: a server under sustained load sees
        nearly identical steps (plain decoding at one batch size), from which alone the cost of extra tokens cannot
        be told apart from the fixed cost, and a refit on them would make speculation look free."""
        self._samples.append((self.features(tokens, context), float(measured_s)))
        self._observed += 1
        if len(self._samples) >= 8 and self._observed % refit_every == 0:
            self.fit_samples(self._anchors + list(self._samples))

    def samples(self) -> list[tuple[np.ndarray, float]]:
        """The (features, measured seconds) pairs kept for refitting (the last `window` observed steps)."""
        return list(self._samples)

    def fit(self, steps: list[tuple[np.ndarray, np.ndarray, float]]) -> None:
        """Least-squares fit from (tokens, context, measured seconds) triples: a calibration sweep, which later
        online refits keep using beside the recent steps (`anchor`)."""
        self.anchor(steps)
        self.fit_samples(self._anchors)

    def anchor(self, steps: list[tuple[np.ndarray, np.ndarray, float]]) -> None:
        """Keep (tokens, context, seconds) triples for every later online refit, without refitting now."""
        self._anchors = [(self.features(t, c), float(m)) for t, c, m in steps]

    @classmethod
    def for_engine(cls, engine, shape: "ModelShape", hardware: HardwareSpec, **kwargs) -> "StepTimeModel":
        """A model that lays out attention as `engine` does: its layout and, where it groups calls, its price of a
        call (`TorchEngine.attention_call_cost`)."""
        return cls(shape, hardware, attention_layout=engine.attention_layout,
                   attention_call_cost=getattr(engine, "attention_call_cost", CALL_COST), **kwargs)

    def clone(self) -> "StepTimeModel":
        """The same model and calibration sweep, with its own (empty) window of online samples."""
        twin = StepTimeModel(self.shape, self.hardware, dtype=self.dtype, coefficients=self.coefficients.copy(),
                             window=self.window, attention_layout=self.attention_layout,
                             attention_call_cost=self.attention_call_cost, row_seconds=self.row_seconds)
        twin._anchors = list(self._anchors)
        return twin

    def fit_samples(self, samples: list[tuple[np.ndarray, float]]) -> None:
        X = np.stack([f for f, _ in samples])
        y = np.array([m for _, m in samples])
        # Relative error matters (a 1 ms miss on a 2 ms step is worse than on a 50 ms one): weight rows by 1/y.
        w = 1.0 / np.maximum(y, 1e-6)
        A, b = X * w[:, None], y * w
        coef = nonnegative_lstsq(A, b)
        # What the budget needs is the typical step right (the median relative error), not the mean pulled by the
        # few steps a burst of background load slowed 2x: reweighted passes (IRLS) move the least-squares fit
        # toward least absolute relative error. Residuals under 1% count as 1%, so exact fits stay exact.
        for _ in range(IRLS_PASSES):
            s = 1.0 / np.sqrt(np.maximum(np.abs(A @ coef - b), 0.01))
            coef = nonnegative_lstsq(A * s[:, None], b * s)
        self.coefficients = coef

    def free_budget(self) -> float:
        """Tokens per step (b*s) at which the linear layers turn compute-bound: peak * bytes / (2 * bandwidth)."""
        return self.hardware.flops(self.dtype) * DTYPE_BYTES[self.dtype] / (2 * self.hardware.mem_bandwidth)


@nb.njit(cache=True)
def _attention_one(rates, n_layers, tokens, context):
    """`StepTimeModel.attention_seconds` of one request (the same operations, so the same bits)."""
    keys = tokens + context
    per_layer = max(rates[13] * tokens * keys, rates[14] * keys + rates[15] * tokens)
    return n_layers * per_layer if tokens > 0 else 0.0


@nb.njit(cache=True)
def prefix_step_seconds(rates, rows_table, n_layers, padded, coefficients, context, attention_calls,
                        candidate_context, candidate_rank):
    """`StepTimeModel.prefix_seconds`: each prefix's feature row (`_prefix_features`) times the coefficients."""
    features = _prefix_features(rates, rows_table, n_layers, context, padded, attention_calls, candidate_context,
                                candidate_rank)
    seconds = np.empty(features.shape[0])
    for k in range(features.shape[0]):
        total = 0.0
        for j in range(features.shape[1]):
            total += features[k, j] * coefficients[j]
        seconds[k] = total
    return seconds


@nb.njit(cache=True)
def _prefix_features(rates, rows_table, n_layers, context, padded, attention_calls, candidate_context,
                     candidate_rank):
    """Feature rows [1, linear, attention, LM head, T, extra calls] of `StepTimeModel.prefix_seconds`' steps."""
    n = candidate_context.shape[0]
    batch = context.shape[0]
    features = np.empty((n + 1, 6))
    # the plain step: its longest keys (padded), or each request's one row priced alone
    attention = 0.0 if padded else _batch_attention(rates, n_layers, np.ones(batch), context, False)
    rows, keys = 1.0, 1.0
    for i in range(batch):
        keys = max(keys, context[i] + 1)
    for k in range(n + 1):
        total = batch + float(k)
        if k > 0:
            before = 1.0 + candidate_rank[k - 1]
            if padded:
                rows = max(rows, before + 1)
                keys = max(keys, candidate_context[k - 1] + before + 1)
            else:
                attention = attention + (_attention_one(rates, n_layers, before + 1, candidate_context[k - 1])
                                         - _attention_one(rates, n_layers, before, candidate_context[k - 1]))
        _fill_features(rates, rows_table, n_layers, total,
                       batch * _attention_one(rates, n_layers, rows, keys - rows) if padded else attention,
                       attention_calls, features[k])
    return features


@nb.njit(cache=True)
def _fill_features(rates, rows_table, n_layers, total, attention, attention_calls, row):
    """One feature row (`FEATURES`) of a step of `total` tokens whose attention costs `attention` seconds. With a
    row table (`row_table`), its price of `total` rows is the linear feature and the LM-head and token ones are 0."""
    row[0] = 1.0
    row[2] = attention
    row[5] = attention_calls
    if rows_table.shape[0] > 0:
        row[1] = _row_price(rows_table, total)
        row[3] = 0.0
        row[4] = 0.0
        return
    linear = 0.0
    for op in range(3):
        linear = linear + max(rates[3 * op] * total, rates[3 * op + 1] + rates[3 * op + 2] * total)
    row[1] = n_layers * (linear + rates[9] * total)
    row[3] = max(rates[10] * total, rates[11] + rates[12] * total)
    row[4] = total


@nb.njit(cache=True)
def _row_price(rows_table, total):
    """A row table's seconds for a step of `total` rows: its entry, or past its end its last entry plus its slope
    (the table's final element) per row."""
    n = rows_table.shape[0] - 1
    t = int(total + 0.5)  # a count of rows, carried as a float
    if t < 1:
        return 0.0
    if t <= n:
        return rows_table[t - 1]
    return rows_table[n - 1] + rows_table[n] * (total - n)


@nb.njit(cache=True)
def _batch_attention(rates, n_layers, tokens, context, one_call):
    """Attention seconds of a step: each request alone (packed), or, `one_call` (a padded batch, a lone request),
    every request padded to the deepest tree over the longest context."""
    n = tokens.shape[0]
    if n == 0:
        return 0.0
    if one_call:
        rows, keys = tokens[0], tokens[0] + context[0]
        for i in range(1, n):
            rows = max(rows, tokens[i])
            keys = max(keys, tokens[i] + context[i])
        return n * _attention_one(rates, n_layers, rows, keys - rows)
    attention = 0.0
    for i in range(n):
        attention += _attention_one(rates, n_layers, tokens[i], context[i])
    return attention


def check_row_table_rows(rows, name: str = "table_rows") -> int:
    """A row table's length as the options that ask for one take it: 0 (none: the roofline prices rows) or >= 2."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or rows == 1:
        raise ValueError(f"{name} must be 0 (no row table) or an int >= 2; got {rows!r}")
    return rows


def row_table(row_seconds) -> np.ndarray:
    """The kernels' form of `StepTimeModel.row_seconds`: its entries, then seconds per row past its end (the least-
    squares slope over the table's upper half: the library's steps average out over a few of them); empty for None."""
    if row_seconds is None:
        return np.zeros(0)
    seconds = np.asarray(row_seconds, dtype=np.float64)
    if seconds.ndim != 1 or seconds.size < 2 or not np.isfinite(seconds).all():
        raise ValueError(f"row_seconds needs the measured extra seconds of 1, 2, ... rows (two or more finite "
                         f"values); got {seconds!r}")
    rows = np.arange(1, seconds.size + 1, dtype=np.float64)
    upper = slice(seconds.size // 2, None)
    slope = np.polyfit(rows[upper], seconds[upper], 1)[0] if seconds.size >= 4 else seconds[-1] - seconds[-2]
    return np.append(seconds, max(float(slope), 0.0))


def step_coefficients(values) -> np.ndarray:
    """Coefficients over `FEATURES` as float64; the 5 of results written before the `attention_calls` feature get a
    0 for it (what those fits implied: its cost was spread over the others)."""
    coefficients = np.asarray(values, dtype=np.float64)
    if coefficients.shape == (len(FEATURES) - 1,):
        coefficients = np.append(coefficients, 0.0)
    if coefficients.shape != (len(FEATURES),):
        raise ValueError(f"step-time coefficients need {len(FEATURES)} values ({', '.join(FEATURES)}); got "
                         f"{coefficients.shape}")
    return coefficients


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (active-set: drop the most negative column, re-solve)."""
    active = np.ones(X.shape[1], dtype=bool)
    active &= np.abs(X).max(axis=0) > 0  # features that never vary carry no information
    coef = np.zeros(X.shape[1])
    while active.any():
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        idx = np.flatnonzero(active)[np.argmin(sol)]
        active[idx] = False
    return coef
