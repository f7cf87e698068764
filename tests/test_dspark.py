"""DSpark drafter: the shared head-drafter tests, the Markov head, the confidence head."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.drafters import build_drafter
from dloop_jax.errors import ConfigError
from dloop_jax.training import dspark_objective
from lossless import assert_same_or_near_tie
from head_drafter_tests import (  # noqa: F401  (fixtures and tests collected here)
    CONFIGS, GAMMA, _teacher_forced, _train, _train_eal, drafters, learnable,
    test_draft_stage_matches_teacher_forced_heads, test_export_and_load, test_greedy_lossless,
    test_loop_aware_objective, test_sampling_first_three_tokens,
    test_trainer_trains_the_tiny_config, test_training_raises_engine_acceptance_length)


@pytest.fixture(scope="module")
def kind():
  return "dspark"


def test_markov_head_raises_training_acceptance(learnable, drafters):
  """Ablation: the same DSpark without its Markov head accepts less on the training set."""
  target, batches, _ = learnable
  config = dict(CONFIGS["dspark"], markov_rank=0)
  _, history = _train(target, batches, config, objective="dspark")
  with_head, without = _train_eal(drafters["history"]), _train_eal(history)
  print(f"\nDSpark training expected acceptance length: Markov head {with_head:.3f},"
        f" without {without:.3f}")
  assert with_head > without + 0.02


def test_confidence_tracks_acceptance(learnable, drafters):
  """The trained confidence head ranks held-out drafts by whether the target accepts them."""
  _, _, held = learnable
  drafter = drafters["trained"]
  data = jax.tree.map(jnp.asarray, draft_training.pack_batch(held, seq_len=48))
  h, y = nnx.jit(_teacher_forced)(drafter, data, jax.random.key(5))
  logits = drafter.head_logits(h, y["prev"])
  valid = np.asarray(y["valid"])
  accepted = np.asarray(jnp.argmax(logits, -1) == y["labels"])[valid]
  conf = np.asarray(jax.nn.sigmoid(drafter.confidence_logit(h, y["prev"])))[valid]
  corr = np.corrcoef(conf, accepted.astype(np.float64))[0, 1]
  # Rank statistic: P(conf of an accepted draft > conf of a rejected one).
  auc = np.mean(conf[accepted][:, None] > conf[~accepted][None, :])
  print(f"\nconfidence vs greedy acceptance on {accepted.size} held-out drafts: correlation"
        f" {corr:.3f}, AUC {auc:.3f}, mean conf {conf.mean():.3f} vs acceptance rate"
        f" {accepted.mean():.3f}")
  assert corr > 0.3 and auc > 0.7
  assert abs(conf.mean() - accepted.mean()) < 0.15  # calibrated, not only ranked


def test_scheduled_by_confidence_head_greedy_lossless(learnable, drafters):
  """schedule="cost" with c_k from the confidence head (the default for DSpark) or from the
  draft probabilities: greedy output = ar, and the head changes what is verified."""
  target, _, held = learnable
  prompts = [h["prompt"] for h in held[:3]]
  ar = generate(target, prompts, max_new_tokens=40)
  runs = {c: generate(target, prompts, max_new_tokens=40, mode="dloop",
                      drafter=drafters["trained"], block_size=3, max_stages=3, gate=-1.0,
                      draft_backoff=0, confidence=c)
          for c in ("auto", "drafter", "probability")}
  for out in runs.values():
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(target, p, want, got)
  stats = {c: out.total.as_dict() for c, out in runs.items()}
  assert stats["auto"] == stats["drafter"] != stats["probability"]
  assert 0 < stats["drafter"]["verified"] < stats["drafter"]["drafted"]


def _modeled_cost(row, *, fixed, per_token):
  """A batch-1 row's summed forward cost under cost(1) = 1, cost(w) = fixed + per_token * w
  (w >= 2): exact from its statistics (plain rounds are the width-1 forwards)."""
  wide = row.rounds - row.plain_rounds
  return row.plain_rounds + wide * fixed + per_token * (row.target_tokens - row.plain_rounds)


# cost(w) / cost(1) of a 2-core CPU (conftest's SmolLM2 table: 1.35, 1.53, 1.63, 1.92, 2.15 at
# widths 2, 3, 4, 7, 10) and of an accelerator (nearly flat), affine past width 1.
MEASURE_TABLES = {"cpu": (1.25, 0.10), "flat": (1.0, 0.02)}


@pytest.mark.skipif(not os.environ.get("DLOOP_MEASURE"),
                    reason="a measurement (minutes), not a check: set DLOOP_MEASURE=1")
def test_measure_confidence_head_as_scheduler(learnable, drafters):
  """docs/drafters.md: c_k from the confidence head vs the top draft probability.

  The trained tiny DSpark, 48 held-out random prompts one at a time (batch 1, so a
  round's width is the row's own), 40 tokens, gamma 3, S_max 3. Per configuration:
  tau, drafts verified / drafted, accepted / verified, and committed tokens per
  unit of modeled target cost (ar: 1).
  """
  target = learnable[0]
  rng = np.random.default_rng(1234)
  prompts = [rng.integers(0, 64, size=int(rng.integers(3, 9))).tolist() for _ in range(48)]
  settings = [("cpu", "greedy", SamplingConfig()), ("flat", "greedy", SamplingConfig()),
              ("cpu", "T=1", SamplingConfig(temperature=1.0))]
  for table, name, sampling in settings:
    fixed, per_token = MEASURE_TABLES[table]
    costs = {w: 1.0 if w == 1 else fixed + per_token * w for w in range(1, 11)}
    for mode, gate in (("sd", 0.0), ("dloop", -1.0)):
      for schedule, confidence, backoff in (("off", "auto", None),
                                            ("cost", "probability", 0), ("cost", "drafter", 0),
                                            ("cost", "probability", None),
                                            ("cost", "drafter", None)):
        rows = [generate(target, [p], max_new_tokens=40, mode=mode, drafter=drafters["trained"],
                         block_size=GAMMA, max_stages=3, gate=gate, schedule=schedule,
                         costs=costs, confidence=confidence, draft_backoff=backoff,
                         sampling=sampling, seed=i).rows[0]
                for i, p in enumerate(prompts)]
        committed = sum(r.committed_in_rounds for r in rows)
        rounds = sum(r.rounds for r in rows)
        drafted, verified = sum(r.drafted for r in rows), sum(r.verified for r in rows)
        accepted = sum(r.accepted for r in rows)
        cost = sum(_modeled_cost(r, fixed=fixed, per_token=per_token) for r in rows)
        print(f"\n{table:4s} {name:6s} {mode:5s} {schedule:4s} {confidence:11s}"
              f" backoff={backoff!s:4s} tau {committed / rounds:.3f}  verified/drafted"
              f" {verified / max(drafted, 1):.3f}  accepted/verified"
              f" {accepted / max(verified, 1):.3f}  tokens/cost {committed / cost:.3f}")


def test_objective_terms(learnable):
  """CE, L1 to the target distribution and the confidence BCE, against numpy."""
  target = learnable[0]
  drafter = build_drafter(CONFIGS["dspark"], target=target, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  shape = (2, 1, 3)
  h = jnp.asarray(rng.normal(size=shape + (32,)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 64, shape), jnp.int32)
  prev = jnp.asarray(rng.integers(0, 64, shape), jnp.int32)
  valid = jnp.asarray([[[True, True, False]], [[True, True, True]]])
  weights = jnp.broadcast_to(jnp.exp(-jnp.arange(3) / 3.0), shape)
  p_t = jax.nn.softmax(jnp.asarray(rng.normal(size=shape + (64,)) * 3, jnp.float32))
  cfg = dspark_objective.DEFAULTS
  loss, correct, m = dspark_objective.stage_loss(drafter, h, labels=labels, prev=prev,
                                                 valid=valid, weights=weights, target_probs=p_t,
                                                 cfg=cfg)
  logp = np.asarray(jax.nn.log_softmax(drafter.head_logits(h, prev)), np.float64)
  w = np.asarray(valid, np.float64) * np.asarray(weights)
  mean = lambda x: (x * w).sum() / w.sum()
  nll = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
  l1 = np.abs(np.exp(logp) - np.asarray(p_t)).sum(-1)
  c = 1 / (1 + np.exp(-np.asarray(drafter.confidence_logit(h, prev), np.float64)))
  c_star = 1 - l1 / 2
  bce = -(c_star * np.log(c) + (1 - c_star) * np.log(1 - c))
  np.testing.assert_allclose(float(m["loss_ce"]), mean(nll), rtol=1e-5)
  np.testing.assert_allclose(float(m["loss_l1"]), mean(l1), rtol=1e-5)
  np.testing.assert_allclose(float(m["loss_confidence"]), mean(bce), rtol=1e-5)
  np.testing.assert_allclose(float(loss), 0.1 * mean(nll) + 0.9 * mean(l1) + mean(bce), rtol=1e-5)
  np.testing.assert_array_equal(correct, (logp.argmax(-1) == np.asarray(labels)) & valid)
  # Without target distributions: the one-hot of the label, so 1/2 L1 = 1 - p_draft(label).
  _, _, m = dspark_objective.stage_loss(drafter, h, labels=labels, prev=prev, valid=valid,
                                        weights=weights, target_probs=None, cfg=cfg)
  np.testing.assert_allclose(float(m["loss_l1"]), mean(2 * (1 - np.exp(-nll))), rtol=1e-5)
  # The target's top-k (what `target_topk` datasets store): with k = V the same
  # loss as the full distribution; with k < V the distribution renormalized on k.
  probs_sorted, ids_sorted = jax.lax.top_k(p_t, 64)
  topk_loss, _, topk_m = dspark_objective.stage_loss(
      drafter, h, labels=labels, prev=prev, valid=valid, weights=weights, target_probs=None,
      target_topk=(ids_sorted, probs_sorted), cfg=cfg)
  np.testing.assert_allclose(float(topk_loss), float(loss), rtol=1e-5)
  np.testing.assert_allclose(float(topk_m["loss_l1"]), mean(l1), rtol=1e-5)
  k = 5
  truncated = np.zeros(np.shape(p_t))
  np.put_along_axis(truncated, np.asarray(ids_sorted[..., :k]), np.asarray(probs_sorted[..., :k]),
                    -1)
  truncated /= truncated.sum(-1, keepdims=True)
  _, _, m5 = dspark_objective.stage_loss(
      drafter, h, labels=labels, prev=prev, valid=valid, weights=weights, target_probs=None,
      target_topk=(ids_sorted[..., :k], probs_sorted[..., :k]), cfg=cfg)
  np.testing.assert_allclose(float(m5["loss_l1"]), mean(np.abs(np.exp(logp) - truncated).sum(-1)),
                             rtol=1e-5)
  # Confidence head off: no BCE term, no confidence metrics.
  bare = build_drafter(dict(CONFIGS["dspark"], enable_confidence_head=False), target=target,
                       rngs=nnx.Rngs(1))
  loss, _, m = dspark_objective.stage_loss(bare, h, labels=labels, prev=prev, valid=valid,
                                           weights=weights, target_probs=p_t, cfg=cfg)
  assert "loss_confidence" not in m
  np.testing.assert_allclose(float(loss), 0.1 * float(m["loss_ce"]) + 0.9 * float(m["loss_l1"]),
                             rtol=1e-6)


def test_config_errors_and_weight_layouts(learnable):
  target = learnable[0]
  with pytest.raises(ConfigError, match="do not apply to kind 'dspark'"):
    build_drafter({"kind": "dspark", "gru_hidden_size": 8}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="do not apply to kind 'block'"):
    build_drafter({"kind": "block", "markov_rank": 8}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="markov_rank must be an int >= 0"):
    build_drafter({"kind": "dspark", "markov_rank": -1}, target=target, rngs=nnx.Rngs(0))
  # Head weights in DeepSpec's layouts (V = 64, D = 32).
  d = build_drafter(CONFIGS["dspark"], target=target, rngs=nnx.Rngs(0))
  assert d.markov_w1.shape == d.markov_w2.shape == (64, 16)
  assert d.confidence_proj.shape == (1, 32 + 16) and d.confidence_bias.shape == (1,)
  bare = build_drafter(dict(CONFIGS["dspark"], markov_rank=0, enable_confidence_head=False),
                       target=target, rngs=nnx.Rngs(0))
  assert bare.markov_w1 is None and bare.confidence_proj is None
  assert d.has_confidence and not bare.has_confidence
  with pytest.raises(ConfigError, match="confidence='drafter' needs a drafter with a learned"):
    generate(target, [[1, 2]], max_new_tokens=4, mode="sd", drafter=bare, confidence="drafter")
  with pytest.raises(ConfigError, match="confidence must be one of"):
    generate(target, [[1, 2]], max_new_tokens=4, mode="sd", drafter=d, confidence="head")
  # The block drafter's config is unchanged (no head keys).
  assert "markov_rank" not in build_drafter({"kind": "block"}, target=target,
                                            rngs=nnx.Rngs(0)).drafter_config()


def test_defaults_for_the_real_target():
  config = draft_training.smollm2_shaped_config()
  d = draft_training.abstract_drafter({"kind": "dspark"}, config)
  assert d.block_size == 7 and d.drafter_config()["markov_rank"] == 256
  assert d.markov_w1.shape == (49152, 256) and d.confidence_proj.shape == (1, 576 + 256)
