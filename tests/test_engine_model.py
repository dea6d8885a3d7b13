"""trt_engines.llama: logits equal transformers' on the same weights (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from trt_engines.llama import ModelArgs, Transformer, causal_attention  # noqa: E402
from trt_engines.prepare import is_complete, default_model_dir  # noqa: E402

TOL = 1e-4


def _ours(folder, tokens: torch.Tensor) -> torch.Tensor:
    model = Transformer.from_folder(folder, dtype=torch.float32)
    return model.logits(model(tokens, torch.arange(len(tokens)), causal_attention()))


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0].float()


def _randomize_biases(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)


def _save_tiny(tmp_path, config, *, shard: bool = False) -> tuple:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize_biases(model)
    model.save_pretrained(tmp_path, max_shard_size="200KB" if shard else "5GB")
    return model


@pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")
def test_default_model_matches_transformers():
    folder = default_model_dir()
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    for length in (1, 23, 70):
        tokens = torch.as_tensor(rng.integers(0, hf.config.vocab_size, length))
        diff = (_ours(folder, tokens) - _hf_logits(hf, tokens)).abs().max().item()
        assert diff <= TOL, f"length {length}: max abs logit diff {diff}"


def test_tiny_qwen2_with_bias_untied_head_sharded(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256, rope_theta=1000.0,
    )
    hf = _save_tiny(tmp_path, config, shard=True)
    assert (tmp_path / "model.safetensors.index.json").is_file(), "the test meant to exercise sharded loading"
    args = ModelArgs.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert args.attention_bias and not args.tie_word_embeddings
    tokens = torch.as_tensor(np.random.default_rng(1).integers(0, 97, 40))
    diff = (_ours(tmp_path, tokens) - _hf_logits(hf, tokens)).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
    ],
    ids=lambda r: r["rope_type"],
)
def test_tiny_llama_rope_variants(tmp_path, rope):
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, rope_scaling=dict(rope, rope_theta=5000.0),
        tie_word_embeddings=True,
    )
    hf = _save_tiny(tmp_path, config)
    tokens = torch.as_tensor(np.random.default_rng(2).integers(0, 101, 120))  # past original_max_position_embeddings
    diff = (_ours(tmp_path, tokens) - _hf_logits(hf, tokens)).abs().max().item()
    assert diff <= TOL, diff


def test_unsupported_configs_are_rejected_clearly():
    base = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 16, "model_type": "llama"}
    ModelArgs.from_config(base)
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelArgs.from_config(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="not a Llama-family"):
        ModelArgs.from_config(dict(base, model_type="gpt2"))
    mistral = ModelArgs.from_config(dict(base, model_type="mistral", sliding_window=64, max_position_embeddings=4096))
    assert mistral.max_position_embeddings == 64  # sliding window caps the context: full attention stays exact


@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_rope_values_of_a_position_do_not_depend_on_the_step(head_dim):
    # Read from tables of every position: the same values as computing them for the step alone, whichever other
    # positions the step holds and in whatever order, including after the tables grew.
    config = {"hidden_size": 4 * head_dim, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": head_dim, "vocab_size": 300, "max_position_embeddings": 4096,
              "rope_theta": 500000.0}
    model = Transformer.random(config, dtype=torch.float32)
    rng = np.random.default_rng(head_dim)
    for size in (1, 2, 5, 9, 300, 1):
        positions = torch.as_tensor(rng.integers(0, 4096 if size == 300 else 700, size))
        cos, sin = model.rope_tables(positions)
        alone = [model._rope_values(positions[i:i + 1]) for i in range(size)]
        assert torch.equal(cos, torch.cat([c for c, _ in alone])) and torch.equal(sin, torch.cat([s for _, s in alone]))
    assert model._rope_cpu[0].shape[0] <= 4096  # never past the model's positions
