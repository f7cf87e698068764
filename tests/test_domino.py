"""Domino drafter: the shared head-drafter tests, the GRU correction head, its curriculum."""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
import reference
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.drafters import build_drafter
from dloop_jax.drafters.domino import gru_step
from dloop_jax.errors import ConfigError
from dloop_jax.training import domino_objective
from lossless import assert_same_or_near_tie
from head_drafter_tests import (  # noqa: F401  (fixtures and tests collected here)
    CONFIGS, GAMMA, GREEDY, STEPS, _expected_acceptance, _held_prompts, _teacher_forced, drafters, learnable,
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


# ------------------------------------------------------------------ DARTree
@functools.partial(nnx.jit, static_argnames=("block_size",))
def _tree_stage(drafter, state, *, block_size):
  state, h = drafter.backbone_stage(state, block_size)
  return h, drafter.draft_tree_stage(
      state.replace(lengths=state.lengths - block_size), block_size=block_size, budget=8)


def test_dartree_nodes_score_their_corrected_paths(learnable, drafters):
  """Every kept prefix scores the teacher-forced corrected log-probability of its path (its
  own GRU state), slot 0 is the greedy chain, and the state continues after that chain."""
  _, _, held = learnable
  drafter = drafters["trained"]
  batch = draft_training.pack_batch(held[:2], seq_len=32)
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], 9)
  h, (after, ts) = _tree_stage(drafter, state, block_size=GAMMA)
  greedy, chain = draft_training.draft_stage(drafter, state, jax.random.key(0),
                                             block_size=GAMMA, sampling=GREEDY)
  beams = jax.tree.map(np.asarray, ts.candidates)
  b, gamma, w = beams.scores.shape
  assert (gamma, w) == (GAMMA, drafter.tree_width)
  np.testing.assert_array_equal(beams.tokens[:, :, 0], chain.tokens)
  np.testing.assert_array_equal(after.anchor, greedy.anchor)
  # Slot 0 scores the chain: the running sum of its log-probabilities.
  np.testing.assert_allclose(beams.scores[:, :, 0], np.cumsum(np.asarray(chain.logprobs), -1),
                             atol=1e-5)
  # Walk every last-depth slot's parents back to the anchor: [anchor, t_1 .. t_gamma].
  paths = np.zeros((b, w, gamma + 1), np.int32)
  paths[:, :, 0] = np.asarray(state.anchor)[:, None]
  slot = np.broadcast_to(np.arange(w), (b, w))
  for d in range(gamma - 1, -1, -1):
    paths[:, :, d + 1] = np.take_along_axis(beams.tokens[:, d], slot, 1)
    slot = np.take_along_axis(beams.parents[:, d], slot, 1) if d else slot
  hs = jnp.broadcast_to(h[:, None], (b, w) + h.shape[1:])
  _, logits = drafter.corrected_logits(hs, jnp.asarray(paths[..., :-1]),
                                       head_rows=state.head_rows)  # inference's bf16 head
  logp = jax.nn.log_softmax(logits)
  want = np.take_along_axis(np.asarray(logp), paths[..., 1:, None], -1)[..., 0].sum(-1)
  np.testing.assert_allclose(beams.scores[:, -1], want, atol=1e-4)
  # Pruned to a budget: prefix-closed and parents first.
  tree, _ = tree_lib.select(ts.candidates, budget=8)
  parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
  assert valid.all() and np.all(parents < np.arange(8))
  depths = np.asarray(tree.depths)
  assert np.all((parents == -1) == (depths == 1))
  assert np.all(np.where(parents >= 0, np.take_along_axis(depths, np.maximum(parents, 0), 1),
                         0) == depths - 1)
  # A budget past the gamma * W kept prefixes: all of them, then padding.
  tree, _ = tree_lib.select(ts.candidates, budget=gamma * w + 2)
  assert np.asarray(tree.valid).sum(1).tolist() == [gamma * w] * b
  assert not np.asarray(tree.valid)[:, -2:].any()


def test_dartree_greedy_lossless(learnable, drafters):
  """DARTree, dloop over trees (gate +inf: one stage, as sd): greedy output = ar.

  One compiled program (the gate is traced); held-out prompts of the shared greedy test.
  """
  target, _, held = learnable
  prompts = _held_prompts(held, 0, 3)
  ar = generate(target, prompts, max_new_tokens=40)
  for gate in (-math.inf, math.inf):
    out = generate(target, prompts, max_new_tokens=40, mode="dloop", drafter=drafters["trained"],
                   block_size=GAMMA, max_stages=2, gate=gate, tree_budget=6)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert len(got) == 40
      assert_same_or_near_tie(target, p, want, got)
    t = out.total
    assert t.accepted <= t.verified == t.drafted and t.acceptance_length > 1.3
    # gate +inf: one tree per round; -inf: every round grows a second tree from the first.
    assert t.stage_histogram[2] == (0 if gate == math.inf else t.rounds)


def test_dartree_sampling_first_three_tokens(learnable, drafters):
  """DARTree over two stages of two positions: the first three tokens follow the target."""
  target = learnable[0]
  sampling = SamplingConfig(temperature=1.0, top_k=4)
  prompt = [3, 14, 15]
  out = generate(target, [prompt] * 1200, max_new_tokens=3, mode="dloop",
                 drafter=drafters["trained"], block_size=2, gate=-math.inf, max_stages=2,
                 sampling=sampling, seed=13, tree_budget=4)
  samples = [tuple(t[:3]) for t in out.tokens]
  exact = reference.exact_distribution(target, prompt, sampling, depth=3)
  assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3
  assert out.total.accepted > 0


@pytest.mark.skipif(not os.environ.get("DLOOP_MEASURE"),
                    reason="a measurement, not a check: set DLOOP_MEASURE=1")
def test_measure_dartree_against_the_chain(learnable, drafters):
  """docs/drafters.md: tau of DARTree vs Domino's chain at the same verification width."""
  target = learnable[0]
  rng = np.random.default_rng(1234)
  prompts = [rng.integers(0, 64, size=int(rng.integers(3, 9))).tolist() for _ in range(64)]
  drafter = drafters["trained"]
  ar = generate(target, prompts, max_new_tokens=40)
  runs = {  # name: (verify width, generate kwargs); schedule "off": every draft verified
      "chain sd (3 drafts)": (4, dict(mode="sd")),
      "DARTree sd B=3": (4, dict(mode="sd", tree_budget=3)),
      "chain dloop g=-inf S=2 (6 drafts)": (7, dict(mode="dloop", gate=-math.inf, max_stages=2)),
      "DARTree sd B=6": (7, dict(mode="sd", tree_budget=6)),
      "chain dloop g=-inf S=3 (9 drafts)": (10, dict(mode="dloop", gate=-math.inf, max_stages=3)),
      "DARTree sd B=9": (10, dict(mode="sd", tree_budget=9)),
      # 3 + 3 nodes and stage 1's best path of 3.
      "DARTree dloop g=-inf S=2 B=3": (10, dict(mode="dloop", gate=-math.inf, max_stages=2,
                                                  tree_budget=3)),
  }
  for name, (width, kw) in runs.items():
    out = generate(target, prompts, max_new_tokens=40, drafter=drafter, block_size=GAMMA,
                   schedule="off", **kw)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(target, p, want, got)
    t = out.total
    print(f"\nwidth {width:2d}  {name:34s} tau {t.acceptance_length:.3f}")
