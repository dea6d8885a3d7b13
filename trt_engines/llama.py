"""A Llama-family decoder in one readable file (gpt-fast style): config, RoPE, RMSNorm, GQA attention, SwiGLU, loading.

Covers Llama 1-3, SmolLM, Mistral and Qwen2 (QKV bias) checkpoints stored as Hugging Face folders
(`config.json` + `model.safetensors` or sharded `model.safetensors.index.json`). No `transformers` import: the
config is read as JSON and weights are loaded with `safetensors`.

Vocabulary:
    packed tokens   the tokens of every sequence in a forward, concatenated along one axis `[T]` (no padding); every
                    linear layer runs once over all of them.
    attention fn    a callable `(layer, q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H*D]` supplied by the caller.
                    It owns the KV cache: it stores the new keys/values wherever it keeps them and decides what each
                    token may see (causal prefix, tree ancestors, ...). The model itself is stateless.

Worked example (dense causal attention over one sequence, no cache):

    model = Transformer.from_folder(path, dtype=torch.float32)
    tokens = torch.tensor([1, 504, 3458]); positions = torch.arange(3)
    hidden = model(tokens, positions, causal_attention)      # [3, dim]
    logits = model.logits(hidden)                            # [3, vocab] float32
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """Model shape only (runtime knobs such as batch size or sampling never enter here)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "default" | "linear" | "llama3", ...}
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """Read a Hugging Face `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not a Llama-family model (llama, mistral, qwen2)")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (SwiGLU with silu only)")
        n_heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        max_pos = config.get("max_position_embeddings", 2048)
        window = config.get("sliding_window")
        if window and config.get("use_sliding_window", model_type == "mistral"):
            # Full attention equals sliding-window attention as long as no sequence outgrows the window.
            max_pos = min(max_pos, int(window))
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=max_pos,
            # Qwen2 always has q/k/v bias and no `attention_bias` key.
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            mlp_bias=config.get("mlp_bias", False),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
        )


def rope_inv_freq(args: ModelArgs) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32) and the cos/sin scale for the configured RoPE variant."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    cfg = args.rope_scaling
    kind = cfg.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / cfg["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
        old_len = cfg["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq, 1.0


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/sin [T, D] fp32. Rotate-half convention (Hugging Face layout), computed in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


TRANSPOSED_ROWS = 255  # rows per product in `Linear.transposed`: oneDNN's W x^T keeps one kernel below 256 columns


class Linear(nn.Linear):
    """`nn.Linear` whose output rows never depend on how many rows are computed together (batch invariance).

    On the CPU a one-row product runs a matrix-vector kernel whose summation order differs from the matrix-matrix
    kernel's, so in bf16 a token's hidden state can differ in the last bit between a step that decodes it alone and one
    that verifies it with draft tokens; near-tied logits then flip and the output diverges. Row counts from 2 to 32
    give bitwise the same rows (measured with oneDNN's bf16 kernels), so a single row is computed as two: the cost
    is the same (the weights are read once either way). An engine may set `kernel` to another batch-invariant
    implementation (`TorchEngine(cpu_kernels=...)`).

    `transposed` (what `TorchEngine` sets on the CPU in bf16): compute x W^T as (W x^T)^T, `TRANSPOSED_ROWS` rows
    per product (a single product returns a transposed view). A single row goes in as two copies of itself: one
    column takes oneDNN's matrix-vector path, 1.5-2.5x slower than two (one-off timings, LM head 3.5 vs 1.5 ms) and
    bitwise the same. Past 32 rows oneDNN's bf16 x W^T switches kernels, and a
    row then changes with the row count and its place (by one bf16 step, enough to flip a near-tie; measured on an
    AVX-512 CPU with bf16 dot products for every SmolLM2 layer shape, depending on the data). W x^T gave bitwise the same rows for every row
    count from 1 to 255 and every place, for every layer shape and input scale tried, equal to x W^T's from 2 to 32
    rows; past 255 rows the 1536-wide input (the MLP's down projection) changed kernels too, hence the row chunks. It is
    as fast or faster below 256 rows (one-off timings on that CPU, LM head: 1.3 vs 2.3 ms for 2 rows, 25 vs 43 ms for
    544 unchunked; whole verify steps: `benchmarks/results/batch_invariance.md`)."""

    kernel: Callable[[Tensor], Tensor] | None = None  # replaces F.linear when set (`trt_engines.cpu_kernels`)
    transposed: bool = False

    def forward(self, x: Tensor, invariant_rows: bool = True) -> Tensor:
        """`invariant_rows=False` (prefills: one request alone, computed the same way by every policy) takes
        oneDNN's x W^T even where `transposed` is set: 1.7-2x faster at 300-1000 rows (one-off timings)."""
        if self.kernel is not None:
            return self.kernel(x)
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.transposed and invariant_rows:
            # a single row goes in as a two-row copy: one column would take oneDNN's slower matrix-vector path (same
            # bits), and a stride-0 expand got other bits than a two-row product on AVX2
            columns = x.repeat(2, 1) if x.shape[0] == 1 else x
            parts = [torch.mm(self.weight, rows.T).T for rows in columns.split(TRANSPOSED_ROWS)]
            y = (parts[0] if len(parts) == 1 else torch.cat(parts))[: x.shape[0]]
            return y if self.bias is None else y + self.bias
        if x.shape[0] == 1:
            return F.linear(x.expand(2, -1), self.weight, self.bias)[:1]
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # fp32 statistics whatever the weight dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        # q, k and v share one matmul; `load_weights` concatenates the checkpoint's three projections.
        self.wqkv = Linear(args.dim, q_out + 2 * kv_out, bias=args.attention_bias)
        self.wo = Linear(q_out, args.dim, bias=False)
        self.split = (q_out, kv_out, kv_out)

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn,
                invariant_rows: bool = True) -> Tensor:
        T, a = x.shape[0], self.args
        q, k, v = self.wqkv(x, invariant_rows).split(self.split, dim=-1)
        q = apply_rope(q.view(T, a.n_heads, a.head_dim), cos, sin)
        k = apply_rope(k.view(T, a.n_kv_heads, a.head_dim), cos, sin)
        return self.wo(attention(layer, q, k, v.view(T, a.n_kv_heads, a.head_dim)), invariant_rows)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate and up, fused
        self.w2 = Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: Tensor, invariant_rows: bool = True) -> Tensor:
        gate, up = self.w13(x, invariant_rows).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up, invariant_rows)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn,
                invariant_rows: bool = True) -> Tensor:
        h = x + self.attention(layer, self.attention_norm(x), cos, sin, attention, invariant_rows)
        return h + self.feed_forward(self.ffn_norm(h), invariant_rows)


class Transformer(nn.Module):
    """The decoder. `forward(tokens [T], positions [T], attention) -> hidden [T, dim]`; `logits(hidden)` -> fp32."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        inv_freq, self.rope_scale = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_cpu: tuple[Tensor, Tensor] | None = None  # cos, sin of positions 0.. (`rope_tables`)

    def rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim] in fp32 for arbitrary (tree) positions. On the CPU they are rows of tables of
        every position up to the largest asked for so far (grown by doubling), computed by the same elementwise ops:
        a position's values never depend on which others a step asks for, and a step pays one gather instead of six
        small ops (24 instead of 62 us for five positions of SmolLM2 on a 2-core AVX2 EPYC, one-off)."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self._rope_values(positions)
        top = int(positions.max()) + 1
        have = 0 if self._rope_cpu is None else self._rope_cpu[0].shape[0]
        if top > have:
            size = min(max(top, 256, 2 * have), max(top, self.args.max_position_embeddings))
            self._rope_cpu = self._rope_values(torch.arange(size))
        cos, sin = self._rope_cpu
        return cos[positions], sin[positions]

    def _rope_values(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def forward(self, tokens: Tensor, positions: Tensor, attention: AttentionFn, *,
                invariant_rows: bool = True) -> Tensor:
        """`invariant_rows`: whether batch-invariant linear layers must keep their invariant form (`Linear`)."""
        cos, sin = self.rope_tables(positions)
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention, invariant_rows)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + LM head on the rows you need (call it on selected rows only: the head is vocab x dim)."""
        # contiguous: the head may return a transposed view (`Linear.transposed`); one copy widens and lays it out
        return self.output(self.norm(hidden)).to(torch.float32, memory_format=torch.contiguous_format)

    @classmethod
    def from_folder(cls, folder: str | Path, *, dtype: torch.dtype = torch.bfloat16, device=None) -> "Transformer":
        folder = Path(folder)
        args = ModelArgs.from_config(json.loads((folder / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(args)
        model.to_empty(device=device or "cpu")
        model.load_weights(read_safetensors(folder), dtype=dtype)
        inv_freq, _ = rope_inv_freq(args)  # to_empty left the buffer uninitialised
        model.inv_freq = inv_freq.to(model.inv_freq.device)
        return model.eval().requires_grad_(False)

    @classmethod
    def random(cls, config: dict, *, dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0) -> "Transformer":
        """A model of `config`'s shape with random weights (timing studies of large shapes without weight files)."""
        args = ModelArgs.from_config(config)
        with torch.device("meta"):
            model = cls(args).to(dtype)  # initialised in `dtype` directly: an 8B shape in fp32 first needs 32 GB
        model.to_empty(device=device or "cpu")
        generator = torch.Generator(device=device or "cpu").manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02, generator=generator) if param.dim() > 1 else param.fill_(1.0)
        inv_freq, _ = rope_inv_freq(args)
        model.inv_freq = inv_freq.to(model.inv_freq.device)
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def load_weights(self, state: dict[str, Tensor], *, dtype: torch.dtype) -> None:
        """Copy a Hugging Face Llama state dict (names `model.layers.{i}.self_attn.q_proj.weight`, ...) into this model."""
        used: set[str] = set()

        def take(name: str) -> Tensor:
            if name not in state:
                raise KeyError(f"checkpoint has no tensor {name!r}; is this a Llama-family model?")
            used.add(name)
            return state[name]

        def put(param: Tensor, value: Tensor) -> None:
            if param.shape != value.shape:
                raise ValueError(f"shape mismatch: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}")
            param.copy_(value.to(dtype))

        a = self.args
        self.to(dtype)
        put(self.tok_embeddings.weight, take("model.embed_tokens.weight"))
        put(self.norm.weight, take("model.norm.weight"))
        if a.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
            used.add("lm_head.weight")  # some tied checkpoints still store it
        else:
            put(self.output.weight, take("lm_head.weight"))
        for i, block in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            put(block.attention.wqkv.weight, torch.cat(qkv))
            if a.attention_bias:
                put(block.attention.wqkv.bias, torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]))
            put(block.attention.wo.weight, take(f"{p}self_attn.o_proj.weight"))
            put(block.feed_forward.w13.weight, torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]))
            put(block.feed_forward.w2.weight, take(f"{p}mlp.down_proj.weight"))
            if a.mlp_bias:
                put(block.feed_forward.w13.bias, torch.cat([take(f"{p}mlp.gate_proj.bias"), take(f"{p}mlp.up_proj.bias")]))
                put(block.feed_forward.w2.bias, take(f"{p}mlp.down_proj.bias"))
            put(block.attention_norm.weight, take(f"{p}input_layernorm.weight"))
            put(block.ffn_norm.weight, take(f"{p}post_attention_layernorm.weight"))
        unused = sorted(k for k in state if k not in used and "rotary_emb" not in k)
        if unused:
            raise ValueError(f"checkpoint tensors not used by the model: {unused[:5]}{' ...' if len(unused) > 5 else ''}")


def read_safetensors(folder: Path) -> dict[str, Tensor]:
    """All tensors of a folder: `model.safetensors`, or the shards listed in `model.safetensors.index.json`."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def causal_attention(cache: dict[int, tuple[Tensor, Tensor]] | None = None) -> Callable:
    """A dense attention fn for ONE sequence without paging (reference and tests): causal over the packed tokens.

    Keeps each layer's K/V in `cache` when given, so tests can inspect them.
    """

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if cache is not None:
            cache[layer] = (k, v)
        T, H, D = q.shape
        g = H // k.shape[1]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1),
            is_causal=True,
        )
        return out.transpose(0, 1).reshape(T, H * D)

    return attend
