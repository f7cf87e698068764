"""Domino drafter: the shared head-drafter tests, the GRU correction head, its curriculum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
from dloop_jax.drafters import build_drafter
from dloop_jax.drafters.domino import gru_step
from dloop_jax.errors import ConfigError
from dloop_jax.training import domino_objective
from head_drafter_tests import (  # noqa: F401  (fixtures and tests collected here)
    CONFIGS, STEPS, _expected_acceptance, _teacher_forced, drafters, learnable,
    test_draft_stage_matches_teacher_forced_heads, test_export_and_load, test_greedy_lossless,
    test_loop_aware_objective, test_sampling_first_three_tokens,
    test_trainer_trains_the_tiny_config, test_training_raises_engine_acceptance_length)


@pytest.fixture(scope="module")
def kind():
  return "domino"


def test_correction_raises_acceptance(learnable, drafters):
  """Ablation: the trained Domino's corrected logits accept more than its base logits alone."""
  _, batches, held = learnable
  drafter = drafters["trained"]
  rates = {}
  for name, data in (("train", batches[0]), ("held", draft_training.pack_batch(held, seq_len=48))):
    h, y = nnx.jit(_teacher_forced)(drafter, jax.tree.map(jnp.asarray, data), jax.random.key(4))
    base, corrected = drafter.corrected_logits(h, y["prev"])
    rates[name] = tuple(_expected_acceptance(jnp.argmax(x, -1) == y["labels"], y["valid"])
                        for x in (base, corrected))
  print(f"\nDomino expected acceptance length (base, corrected): {rates}")
  assert rates["train"][1] > rates["train"][0] + 0.02
  assert rates["held"][1] > rates["held"][0]


def test_base_anchored_curriculum(drafters):
  """lambda falls 1 -> 0 over the first half of training, then stays 0."""
  lam = [h["base_weight"] for h in drafters["history"]]
  assert lam[0] == 1.0 and abs(lam[STEPS // 4] - 0.5) < 0.01 and max(lam[STEPS // 2:]) == 0.0
  assert float(domino_objective.base_weight(None, 0.5)) == 0.0
  assert float(domino_objective.base_weight(0.1, 0.0)) == 0.0


def test_gru_is_pytorchs(learnable):
  """gru_step is torch.nn.GRU(bias=False): gates r, z, n in that order."""
  rng = np.random.default_rng(0)
  g, d = 4, 3
  w_ih, w_hh = rng.normal(size=(3 * g, d)), rng.normal(size=(3 * g, g))
  x, h = rng.normal(size=(2, d)), rng.normal(size=(2, g))
  sig = lambda v: 1 / (1 + np.exp(-v))
  r = sig(x @ w_ih[:g].T + h @ w_hh[:g].T)
  z = sig(x @ w_ih[g:2 * g].T + h @ w_hh[g:2 * g].T)
  n = np.tanh(x @ w_ih[2 * g:].T + r * (h @ w_hh[2 * g:].T))
  want = (1 - z) * n + z * h
  got = gru_step(jnp.asarray(h), jnp.asarray(x @ w_ih.T), jnp.asarray(w_hh))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  # The drafting table is the training path's input projection of every token.
  drafter = build_drafter(CONFIGS["domino"], target=learnable[0], rngs=nnx.Rngs(0))
  state = drafter.init_state(batch_size=1, capacity=64)
  np.testing.assert_allclose(np.asarray(state.gru_table),
                             np.asarray(drafter.gru_inputs(jnp.arange(64))), atol=1e-6)


def test_config_errors_and_weight_layouts(learnable):
  target = learnable[0]
  with pytest.raises(ConfigError, match="do not apply to kind 'domino'"):
    build_drafter({"kind": "domino", "markov_rank": 8}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="correction_rank must be an int >= 1"):
    build_drafter({"kind": "domino", "correction_rank": 0}, target=target, rngs=nnx.Rngs(0))
  # Head weights in Domino's layouts (V = 64, D = 32, G = 32, r = 16).
  d = build_drafter(CONFIGS["domino"], target=target, rngs=nnx.Rngs(0))
  assert d.gru_w_ih.shape == (96, 32) and d.gru_w_hh.shape == (96, 32)
  assert d.correction_w1.shape == (16, 64) and d.correction_w2.shape == (64, 16)


def test_defaults_for_the_real_target():
  config = draft_training.smollm2_shaped_config()
  d = draft_training.abstract_drafter({"kind": "domino"}, config)
  assert d.gru_w_hh.shape == (3 * 144, 144) and d.correction_w2.shape == (49152, 256)
