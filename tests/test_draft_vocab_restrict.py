"""`with_draft_vocab`: a trained full-vocabulary block drafter restricted to its commonest ids."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dloop_jax.decoding import generate
from dloop_jax.drafters import build_drafter, with_draft_vocab
from dloop_jax.errors import ConfigError
from lossless import assert_same_or_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 24


@pytest.fixture(scope="module")
def full(tiny):
  drafter = build_drafter({"kind": "block", "block_size": 3, "num_layers": 1}, target=tiny,
                          rngs=nnx.Rngs(4))
  # Nonzero weights everywhere (the initialisation zeroes nothing, but make it explicit).
  nnx.update(drafter, jax.tree.map(lambda x: x + 0.01, nnx.state(drafter, nnx.Param)))
  return drafter


def _counts(vocab, seed=0):
  return np.random.default_rng(seed).integers(0, 1000, size=vocab)


def test_keeps_weights_and_the_logits_of_the_kept_ids(tiny, full):
  counts = _counts(tiny.config.vocab_size)
  restricted = with_draft_vocab(full, counts, size=SIZE, target=tiny)
  d2t = np.asarray(restricted.d2t[...])
  np.testing.assert_array_equal(np.sort(d2t), np.sort(np.argsort(-counts, kind="stable")[:SIZE]))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(full, nnx.Param)),
                               nnx.to_flat_state(nnx.state(restricted, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
  h = jax.random.normal(jax.random.key(0), (2, 3, tiny.config.hidden_size))
  np.testing.assert_allclose(np.asarray(restricted.draft_logits(h)),
                             np.asarray(full.draft_logits(h))[..., d2t], rtol=1e-6, atol=1e-6)
  # The state's head rows are the kept ids' rows.
  state = restricted.init_state(batch_size=1, capacity=8)
  assert state.head_rows.shape == (SIZE, tiny.config.hidden_size)


def test_restricted_drafter_is_lossless(tiny, full):
  restricted = with_draft_vocab(full, _counts(tiny.config.vocab_size, 1), size=SIZE, target=tiny)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 64, size=int(rng.integers(2, 10))).tolist() for _ in range(3)]
  ar = generate(tiny, prompts, max_new_tokens=12)
  for mode in ("sd", "dloop"):
    out = generate(tiny, prompts, max_new_tokens=12, mode=mode, drafter=restricted,
                   schedule="off", gate=-jnp.inf if mode == "dloop" else -0.5, max_stages=2)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny, p, want, got)


def test_refuses_what_it_cannot_restrict(tiny, full):
  counts = _counts(tiny.config.vocab_size)
  with pytest.raises(ConfigError, match="own head"):
    eagle3 = build_drafter({"kind": "eagle3", "block_size": 3, "draft_vocab_size": 0},
                           target=tiny, rngs=nnx.Rngs(0))
    with_draft_vocab(eagle3, counts, size=SIZE, target=tiny)
  restricted = with_draft_vocab(full, counts, size=SIZE, target=tiny)
  with pytest.raises(ConfigError, match="already drafts over a vocabulary of 24"):
    with_draft_vocab(restricted, counts, size=16, target=tiny)
  with pytest.raises(ConfigError, match=r"must be in \(0, 64\)"):
    with_draft_vocab(full, counts, size=64, target=tiny)
  with pytest.raises(ConfigError, match=r"shape \(64,\)"):
    with_draft_vocab(full, counts[:10], size=SIZE, target=tiny)


def test_cli_needs_both_flags_before_loading_anything():
  proc = subprocess.run([sys.executable, "-m", "train.export", "--drafter", "x", "--out", "y",
                         "--draft-vocab-size", "16"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2
  assert "--draft-vocab-size and --token-counts go together" in proc.stderr
