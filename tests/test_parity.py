"""Logit parity of our Flax transformer with the PyTorch transformers reference.

(a) Tiny random Llama / Qwen2 / Qwen3 models, loaded from HF directories
    (single and sharded safetensors) and from GGUF files written the way
    llama.cpp's converter writes them: max |diff| <= 1e-4.
The real default model's parity is in test_generate_real.py (which loads the
model pair once for its generation tests too).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import model_fixtures
from dloop_jax.models import load_target
from dloop_jax.models.gguf_loader import load_gguf
from dloop_jax.models.hf_loader import load_hf_dir
from dloop_jax.models.transformer import WEIGHTS_LEFT_MAX_ROWS, Transformer, project_rows

torch.set_num_threads(1)  # see model_fixtures

TINY_TOL = 1e-4
def _tokens(vocab: int, *, batch: int = 2, length: int = 13, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int32)


@pytest.mark.parametrize("kind", sorted(model_fixtures.TINY_CONFIGS))
def test_hf_dir_parity(kind, tmp_path):
  reference = model_fixtures.tiny_hf_model(kind)
  path = model_fixtures.save_hf(reference, str(tmp_path / kind))
  config, params = load_hf_dir(path)
  assert config.tie_embeddings == reference.config.tie_word_embeddings
  assert ("lm_head" in params) != config.tie_embeddings
  model = Transformer.from_params(config, params)
  tokens = _tokens(config.vocab_size)
  expected = model_fixtures.torch_logits(reference, tokens)
  np.testing.assert_allclose(model_fixtures.flax_logits(model, tokens), expected, atol=TINY_TOL, rtol=0)
  np.testing.assert_allclose(model_fixtures.flax_logits(model, tokens, split=8), expected, atol=TINY_TOL, rtol=0)


def test_llama3_rope_scaling_is_read(tmp_path):
  # Logits at short positions barely feel the scaled low frequencies, so check
  # the parsed config too (transformers 5 writes it under `rope_parameters`).
  reference = model_fixtures.tiny_hf_model("llama_untied_llama3_rope")
  config, _ = load_hf_dir(model_fixtures.save_hf(reference, str(tmp_path / "m")))
  assert config.rope_scaling is not None
  assert config.rope_scaling.factor == 8.0
  assert config.rope_scaling.original_max_position_embeddings == 16


def test_sharded_hf_dir_parity(tmp_path):
  reference = model_fixtures.tiny_hf_model("qwen2_untied", seed=3)
  path = model_fixtures.save_hf(reference, str(tmp_path / "sharded"), max_shard_size="40KB")
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  assert not os.path.exists(os.path.join(path, "model.safetensors"))
  config, params = load_hf_dir(path)
  model = Transformer.from_params(config, params)
  tokens = _tokens(config.vocab_size, seed=1)
  np.testing.assert_allclose(
      model_fixtures.flax_logits(model, tokens), model_fixtures.torch_logits(reference, tokens),
      atol=TINY_TOL, rtol=0)


def test_hf_dir_bf16_checkpoint(tmp_path):
  # bf16 safetensors cannot be read by safetensors' numpy framework.
  reference = model_fixtures.tiny_hf_model("llama_tied", seed=4).to(torch.bfloat16)
  path = model_fixtures.save_hf(reference, str(tmp_path / "bf16"))
  config, params = load_hf_dir(path)
  model = Transformer.from_params(config, params)
  tokens = _tokens(config.vocab_size, seed=2)
  # The reference runs in f32 on the same bf16-rounded weights, reloaded so
  # that its RoPE buffers are recomputed in f32 (`.float()` would keep them bf16).
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()
  expected = model_fixtures.torch_logits(reference, tokens)
  np.testing.assert_allclose(model_fixtures.flax_logits(model, tokens), expected, atol=TINY_TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2_untied", "qwen3_tied"])
def test_gguf_parity(kind, tmp_path):
  reference = model_fixtures.tiny_hf_model(kind, seed=5)
  path = model_fixtures.write_gguf(reference, str(tmp_path / f"{kind}.gguf"))
  config, params = load_gguf(path)
  assert config.family == reference.config.model_type
  assert config.tie_embeddings == reference.config.tie_word_embeddings
  model = Transformer.from_params(config, params)
  tokens = _tokens(config.vocab_size, seed=3)
  np.testing.assert_allclose(
      model_fixtures.flax_logits(model, tokens, split=5), model_fixtures.torch_logits(reference, tokens),
      atol=TINY_TOL, rtol=0)


def test_gguf_llama3_rope_factors(tmp_path):
  # llama.cpp stores Llama-3 scaling as a `rope_freqs` tensor; with the usual
  # Llama 3.1 parameters the loader recovers them.
  overrides = dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192))
  config_cls, base = model_fixtures.TINY_CONFIGS["llama_tied"]
  hf_config = config_cls(**{**model_fixtures._BASE, **base, **overrides, "rope_theta": 500000.0})
  reference = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  factors = model_fixtures._llama3_rope_factors(reference.config)
  assert 1.0 < factors.max() and factors.min() == 1.0  # all three bands present
  path = model_fixtures.write_gguf(reference, str(tmp_path / "l3.gguf"), rope_factors=factors)
  config, _ = load_gguf(path)
  assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
  assert config.rope_scaling.original_max_position_embeddings == 8192


def test_load_target_bf16(tmp_path):
  reference = model_fixtures.tiny_hf_model("qwen3_tied", seed=6)
  tokens = _tokens(reference.config.vocab_size, seed=4)
  expected = model_fixtures.torch_logits(reference, tokens)
  for source in (model_fixtures.save_hf(reference, str(tmp_path / "hf")),
                 model_fixtures.write_gguf(reference, str(tmp_path / "m.gguf"))):
    target = load_target(source, dtype=jnp.bfloat16)
    assert target.model.layers[0].wqkv[...].dtype == jnp.bfloat16
    # bf16 weights and activations: only a loose match is expected.
    assert np.max(np.abs(model_fixtures.flax_logits(target.model, tokens) - expected)) < 0.25
  assert target.tokenizer is not None and target.name == "m"


@pytest.mark.parametrize("lead", [(1,), (2, 3), (1, WEIGHTS_LEFT_MAX_ROWS),
                                  (WEIGHTS_LEFT_MAX_ROWS + 1,)])
def test_tied_head_products_agree_across_row_counts(lead):
  """The tied head's two product forms (few rows: matrix on the left) give h @ rows.T."""
  rng = np.random.default_rng(len(lead) * 10 + lead[-1])
  rows = rng.normal(size=(96, 16)).astype(np.float32)
  hidden = rng.normal(size=lead + (16,)).astype(np.float32)
  got = np.asarray(jax.jit(project_rows)(jnp.asarray(hidden), jnp.asarray(rows)))
  assert got.shape == lead + (96,) and got.dtype == np.float32
  np.testing.assert_allclose(got, hidden @ rows.T, atol=1e-4, rtol=1e-5)
