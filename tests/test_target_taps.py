"""Our target's tap features against transformers' `output_hidden_states`.

The drafter formats name target layers by 0-based decoder-layer id l and read
transformers' `hidden_states[l + 1]` (DFlash's `extract_context_feature`;
EAGLE-3's captures are those layers' outputs). On tiny random Llama, Qwen2 and
Qwen3 models saved by transformers and read by our loader, our taps at every
layer equal those states, except the last layer: transformers returns it after
the final norm, ours before it (the normed one is our `hidden`). DFlash-family
checkpoints tapping the last layer are therefore refused
(`hf_format/dflash.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from dloop_jax.models.config import default_taps
from dloop_jax.models.registry import load_target
from dloop_jax.models.transformer import rms_norm

torch.set_num_threads(1)  # see model_fixtures

L, N = 6, 10
COMMON = dict(vocab_size=80, hidden_size=48, intermediate_size=96, num_hidden_layers=L,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
              max_position_embeddings=64, tie_word_embeddings=False)
MODELS = {
    "llama31": lambda: LlamaForCausalLM(LlamaConfig(
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=8), **COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, **COMMON)),
}


def _dflash_default_taps(num_taps: int) -> list[int]:
  """z-lab's `build_target_layer_ids` for this depth (what a DFlash config names by default)."""
  return [round(1 + i * (L - 4) / (num_taps - 1)) for i in range(num_taps)]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_taps_are_transformers_hidden_states(tmp_path, family):
  torch.manual_seed(0)
  hf = MODELS[family]().eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("bias") or p.ndim == 1:  # Qwen2's q/k/v biases, norms: not trivial
        p.add_(0.1 * torch.randn(p.shape))
      else:
        p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
  hf.save_pretrained(str(tmp_path))
  model = load_target(str(tmp_path), dtype=jnp.float32, weights="f32").model
  prompt = np.random.default_rng(1).integers(0, 80, N)
  with torch.no_grad():
    states = hf(torch.as_tensor(prompt[None]), output_hidden_states=True).hidden_states
  out = model(jnp.asarray(prompt, jnp.int32)[None], positions=jnp.arange(N)[None],
              cache=model.init_cache(batch_size=1, capacity=N), taps=tuple(range(L)))
  ours = np.asarray(out.taps[0])  # [N, L, D]
  named = set(default_taps(L)) | set(_dflash_default_taps(3)) | set(_dflash_default_taps(5))
  assert named <= set(range(L - 1))  # the formats' default taps stop before the last layer
  for layer in range(L - 1):
    np.testing.assert_allclose(ours[:, layer], states[layer + 1][0].numpy(), rtol=1e-4,
                               atol=1e-4, err_msg=f"{family} layer {layer}")
  # The last layer: transformers' state is after the final norm; ours is before it.
  last = states[L][0].numpy()
  assert np.abs(ours[:, L - 1] - last).max() > 1e-2
  normed = rms_norm(out.taps[0, :, L - 1], model.final_norm[...], model.config.rms_norm_eps)
  np.testing.assert_allclose(np.asarray(normed), last, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(out.hidden[0]), last, rtol=1e-4, atol=1e-4)
