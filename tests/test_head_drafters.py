"""DSpark and Domino drafters: losslessness, sampling, train / inference agreement, training.

One module for both (they share the data, the target and, per kind, the
compiled engine programs): every greedy `generate` call of a kind uses the
same batch of 3 (or 1) held-out prompts, gamma 3, S_max 3, 40 new tokens and
schedule "off", so the gates and the drafter weights are array arguments of a
few compiled programs. The target is `tiny_target(seed=1, init_std=0.2)`, the
learnable tiny target of `test_objectives.py`.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
import reference
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.drafters import DominoDrafter, DSparkDrafter, Frozen, build_drafter
from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.models.config import tiny_target
from dloop_jax.training import objectives
from lossless import assert_same_or_near_tie

GAMMA = 3
STEPS = 300
GREEDY = SamplingConfig()
CONFIGS = {
    "dspark": {"kind": "dspark", "block_size": GAMMA, "markov_rank": 16},
    "domino": {"kind": "domino", "block_size": GAMMA, "gru_hidden_size": 32,
               "correction_rank": 16},
}
TRAIN_CFG = {"anchors_per_sequence": 8}


@pytest.fixture(scope="module")
def learnable():
  target = tiny_target(seed=1, init_std=0.2)
  # One generate call (one compiled program) for the training and the held-out examples.
  examples = draft_training.make_examples(target, taps=(0, 1), num_prompts=265,
                                          max_new_tokens=40, seed=0)
  train, held = examples[:256], examples[256:]
  batches = [draft_training.pack_batch(train[i:i + 16], seq_len=48)
             for i in range(0, len(train), 16)]
  return target, batches, held


def _train(target, batches, config, *, objective, cfg=TRAIN_CFG, steps=STEPS):
  drafter = build_drafter(config, target=target, rngs=nnx.Rngs(0))
  history = draft_training.train(drafter, batches, objective=objective, cfg=cfg, steps=steps)
  return drafter, history


@pytest.fixture(scope="module")
def drafters(learnable):
  """Per kind: untrained and trained drafters (same config), and the training history."""
  target, batches, _ = learnable
  out = {}
  for kind, config in CONFIGS.items():
    trained, history = _train(target, batches, config, objective=kind)
    untrained = build_drafter(config, target=target, rngs=nnx.Rngs(0))
    out[kind] = {"untrained": untrained, "trained": trained, "history": history}
  return out


def _generate(target, prompts, **kw):
  kw.setdefault("mode", "dloop")
  return generate(target, prompts, max_new_tokens=40, block_size=GAMMA, max_stages=3,
                  schedule="off", **kw)


def _held_prompts(held, start, batch):
  return [h["prompt"] for h in held[start:start + batch]]


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless(learnable, drafters, kind, batch):
  target, _, held = learnable
  for start in (0, 3):  # two prompt sets
    prompts = _held_prompts(held, start, batch)
    ar = generate(target, prompts, max_new_tokens=40)
    for name in ("untrained", "trained"):
      drafter = drafters[kind][name]
      # mode "sd" is the engine's S_max = 1 program: one batch size suffices (it
      # compiles a program of its own); gate +inf checks the same in dloop's.
      runs = [dict(gate=g) for g in (-math.inf, -0.5, math.inf)]
      if batch > 1:
        runs.append(dict(mode="sd"))
      for run in runs:
        out = _generate(target, prompts, drafter=drafter, **run)
        for p, want, got in zip(prompts, ar.tokens, out.tokens):
          assert len(got) == 40
          assert_same_or_near_tie(target, p, want, got)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_sampling_first_three_tokens(learnable, drafters, kind):
  """The first three tokens follow the target's distribution.

  Token 1 comes from the prefill, tokens 2 and 3 from verifying d_1 and d_2 of
  one stage, where d_2 is sampled from the head's distribution given d_1 (the
  Markov bias / the GRU state): the rejection rule must see exactly that q.
  """
  target = learnable[0]
  sampling = SamplingConfig(temperature=1.0, top_k=4)
  prompt = [3, 14, 15]
  out = generate(target, [prompt] * 2000, max_new_tokens=3, mode="dloop",
                 drafter=drafters[kind]["trained"], block_size=2, gate=-math.inf, max_stages=2,
                 sampling=sampling, seed=12)
  samples = [tuple(t[:3]) for t in out.tokens]
  exact = reference.exact_distribution(target, prompt, sampling, depth=3)
  assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3


# ---------------------------------------------------- inference = training path
def _hidden(drafter, batch, n, num_stages):
  return nnx.jit(lambda d, b: d.train_stages(
      tokens=b["tokens"], features=b["features"], positions=b["positions"],
      segment_ids=b["segment_ids"], anchors=jnp.full((b["tokens"].shape[0], 1), n, jnp.int32),
      block_size=GAMMA, num_stages=num_stages))(drafter, jax.tree.map(jnp.asarray, batch))


def _head_logits(drafter, h, prev):
  if isinstance(drafter, DSparkDrafter):
    return drafter.head_logits(h, prev)
  return drafter.corrected_logits(h, prev)[1]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_draft_stage_matches_teacher_forced_heads(learnable, drafters, kind):
  """A stage's sequential head equals the training path's heads fed the stage's own drafts.

  Stage 1 from target context and a stage 2 from stand-in context (anchored at
  the ground-truth token, as in training), each against `train_stages` and the
  teacher-forced heads with prev = [anchor, d_1, .., d_{gamma-1}].
  """
  _, _, held = learnable
  drafter = drafters[kind]["trained"]
  batch = draft_training.pack_batch(held[:2], seq_len=32)
  n = 9
  hs = _hidden(drafter, batch, n, 2)
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], n)
  anchors = [batch["tokens"][:, n], batch["tokens"][:, n + GAMMA]]
  for stage in range(2):
    if stage:
      state = state.replace(anchor=jnp.asarray(anchors[1]))
    state, drafted = draft_training.draft_stage(drafter, state, jax.random.key(0),
                                                block_size=GAMMA, sampling=GREEDY)
    tokens = np.asarray(drafted.tokens)
    prev = np.concatenate([anchors[stage][:, None], tokens[:, :-1]], axis=1)
    logits = _head_logits(drafter, hs[stage][:, 0], jnp.asarray(prev))
    np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, -1)))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens)[..., None], -1)
    np.testing.assert_allclose(drafted.logprobs, logp[..., 0], atol=1e-5)
    if kind == "dspark":
      conf = jax.nn.sigmoid(drafter.confidence_logit(hs[stage][:, 0], jnp.asarray(prev)))
      np.testing.assert_allclose(drafted.confidence, conf, atol=1e-5)
    else:
      assert drafted.confidence is None
  assert np.all(np.asarray(state.lengths) == n + 2 * GAMMA)


# ------------------------------------------------------------------ training
def _tau(target, drafter, held):
  # gate +inf: one stage per round, every draft verified (speculative decoding).
  taus = [_generate(target, _held_prompts(held, s, 3), drafter=drafter, gate=math.inf).total
          for s in (0, 3, 6)]
  return sum(t.acceptance_length * t.target_forwards for t in taus) / sum(
      t.target_forwards for t in taus)


def _train_eal(history):
  return float(np.mean([h["expected_acceptance_length"] for h in history[-30:]]))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_training_raises_engine_acceptance_length(learnable, drafters, kind):
  target, _, held = learnable
  before = _tau(target, drafters[kind]["untrained"], held)
  after = _tau(target, drafters[kind]["trained"], held)
  print(f"\n{kind}: engine acceptance length {before:.3f} untrained -> {after:.3f} after"
        f" {STEPS} steps (train expected acceptance length"
        f" {_train_eal(drafters[kind]['history']):.3f})")
  assert before < 1.1
  assert after > before + 0.3


def test_markov_head_raises_training_acceptance(learnable, drafters):
  """Ablation: the same DSpark without its Markov head accepts less on the training set."""
  target, batches, _ = learnable
  config = dict(CONFIGS["dspark"], markov_rank=0)
  _, history = _train(target, batches, config, objective="dspark")
  with_head, without = _train_eal(drafters["dspark"]["history"]), _train_eal(history)
  print(f"\nDSpark training expected acceptance length: Markov head {with_head:.3f},"
        f" without {without:.3f}")
  assert with_head > without + 0.02


def _teacher_forced(drafter, batch, key):
  """Held-out stage-1 predictions: labels, valid, prev and hidden states [B, A, gamma, ...]."""
  b = objectives._batch(batch)  # pylint: disable=protected-access
  anchors, ok = objectives.sample_anchors(key, b, 16)
  (h,) = drafter.train_stages(tokens=b["tokens"], features=b["features"],
                              positions=b["positions"], segment_ids=b["segment_ids"],
                              anchors=anchors, block_size=GAMMA, num_stages=1)
  y = objectives._stage_targets(b, anchors, ok, stage=0, gamma=GAMMA)  # pylint: disable=protected-access
  return h, y


def _expected_acceptance(correct, valid):
  """1 + sum_k prod_{i<=k} acc_i over blocks whose k drafts all count (as the metric)."""
  c = np.asarray(correct & valid, np.float64)
  v = np.asarray(valid, np.float64)
  acc = c.sum((0, 1)) / np.maximum(v.sum((0, 1)), 1)
  return 1 + np.sum(np.cumprod(acc))


def test_domino_correction_raises_acceptance(learnable, drafters):
  """Ablation: the trained Domino's corrected logits accept more than its base logits alone."""
  _, batches, held = learnable
  drafter = drafters["domino"]["trained"]
  rates = {}
  for name, data in (("train", batches[0]), ("held", draft_training.pack_batch(held, seq_len=48))):
    h, y = nnx.jit(_teacher_forced)(drafter, jax.tree.map(jnp.asarray, data), jax.random.key(4))
    base, corrected = drafter.corrected_logits(h, y["prev"])
    rates[name] = tuple(_expected_acceptance(jnp.argmax(x, -1) == y["labels"], y["valid"])
                        for x in (base, corrected))
  print(f"\nDomino expected acceptance length (base, corrected): {rates}")
  assert rates["train"][1] > rates["train"][0] + 0.02
  assert rates["held"][1] > rates["held"][0]
  # The base-anchored curriculum: base weight 1 -> 0 over the first half, then 0.
  lam = [h["base_weight"] for h in drafters["domino"]["history"]]
  assert lam[0] == 1.0 and abs(lam[STEPS // 4] - 0.5) < 0.01 and max(lam[STEPS // 2:]) == 0.0


def test_confidence_tracks_acceptance(learnable, drafters):
  """The trained confidence head ranks held-out drafts by whether the target accepts them."""
  _, _, held = learnable
  drafter = drafters["dspark"]["trained"]
  data = jax.tree.map(jnp.asarray, draft_training.pack_batch(held, seq_len=48))
  h, y = nnx.jit(_teacher_forced)(drafter, data, jax.random.key(5))
  logits = drafter.head_logits(h, y["prev"])
  accepted = np.asarray(jnp.argmax(logits, -1) == y["labels"])[np.asarray(y["valid"])]
  conf = np.asarray(jax.nn.sigmoid(drafter.confidence_logit(h, y["prev"])))[
      np.asarray(y["valid"])]
  corr = np.corrcoef(conf, accepted.astype(np.float64))[0, 1]
  # Rank statistic: P(conf of an accepted draft > conf of a rejected one).
  auc = np.mean(conf[accepted][:, None] > conf[~accepted][None, :])
  print(f"\nconfidence vs greedy acceptance on {accepted.size} held-out drafts: correlation"
        f" {corr:.3f}, AUC {auc:.3f}, mean conf {conf.mean():.3f} vs acceptance rate"
        f" {accepted.mean():.3f}")
  assert corr > 0.3 and auc > 0.7
  assert abs(conf.mean() - accepted.mean()) < 0.15  # calibrated, not only ranked


def test_dspark_objective_terms(learnable):
  """L1 and the confidence target use the target's distribution when the batch has it."""
  target, batches, _ = learnable
  drafter = build_drafter(CONFIGS["dspark"], target=target, rngs=nnx.Rngs(1))
  batch = jax.tree.map(jnp.asarray, batches[0])
  logits = target(batch["tokens"], positions=batch["positions"],
                  cache=target.init_cache(batch_size=16, capacity=48)).logits
  # Eager: compiling the loss once for these two calls would take longer.
  loss_of = lambda d, b, key: objectives.loss_fn(d, b, key, objective="dspark",
                                                 cfg={"anchors_per_sequence": 8})
  key = jax.random.key(0)
  _, one_hot = loss_of(drafter, batch, key)
  _, soft = loss_of(drafter, dict(batch, target_logits=logits), key)
  # With one-hot targets 1/2 L1 = 1 - p_draft(label); the CE term does not see targets.
  assert soft["loss_ce"] == pytest.approx(float(one_hot["loss_ce"]), rel=1e-6)
  assert float(soft["loss_l1"]) < float(one_hot["loss_l1"])
  assert float(soft["acceptance_prob_mean"]) > float(one_hot["acceptance_prob_mean"])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_loop_aware_objective(learnable, drafters, kind):
  """One loop-aware stage is the base objective; two stages train on stand-in context."""
  _, batches, _ = learnable
  drafter = drafters[kind]["trained"]
  batch = jax.tree.map(jnp.asarray, batches[1])
  key = jax.random.key(7)
  loss_of = lambda d, b, k, cfg: objectives.loss_fn(d, b, k, objective=cfg[0], cfg=dict(cfg[1]))
  base, _ = loss_of(drafter, batch, key, (kind, tuple(TRAIN_CFG.items())))
  one, m1 = loss_of(drafter, batch, key, ("loop_aware", (("fixed_stages", 1),
                                                         ("anchors_per_sequence", 8))))
  two, m2 = loss_of(drafter, batch, key, ("loop_aware", (("fixed_stages", 2),
                                                         ("anchors_per_sequence", 8))))
  np.testing.assert_allclose(float(one), float(base), rtol=1e-5)
  assert float(m2["num_stages"]) == 2 and np.isfinite(float(two))
  assert float(m2["loss_last"]) != float(m2["loss_first"])


# -------------------------------------------------------------- config, export
def test_config_errors_and_round_trip(learnable, tmp_path):
  target = learnable[0]
  for kind, config in CONFIGS.items():
    drafter = build_drafter(config, target=target, rngs=nnx.Rngs(0))
    assert isinstance(drafter, DSparkDrafter if kind == "dspark" else DominoDrafter)
    resolved = json.loads(json.dumps(drafter.drafter_config()))
    assert build_drafter(resolved, target=target, rngs=nnx.Rngs(1)).drafter_config() == resolved
    frozen = {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(drafter, Frozen))}
    assert frozen <= {"embed", "lm_head"}
    with pytest.raises(ConfigError, match="full vocabulary"):
      build_drafter(dict(config, draft_vocab_size=32), target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="do not apply to kind 'dspark'"):
    build_drafter({"kind": "dspark", "gru_hidden_size": 8}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="do not apply to kind 'block'"):
    build_drafter({"kind": "block", "markov_rank": 8}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="markov_rank must be an int >= 0"):
    build_drafter({"kind": "dspark", "markov_rank": -1}, target=target, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="correction_rank must be an int >= 1"):
    build_drafter({"kind": "domino", "correction_rank": 0}, target=target, rngs=nnx.Rngs(0))
  # Head weights in the public checkpoints' layouts (V = 64, D = 32).
  dspark = build_drafter(CONFIGS["dspark"], target=target, rngs=nnx.Rngs(0))
  assert dspark.markov_w1.shape == dspark.markov_w2.shape == (64, 16)
  assert dspark.confidence_proj.shape == (1, 32 + 16) and dspark.confidence_bias.shape == (1,)
  bare = build_drafter(dict(CONFIGS["dspark"], markov_rank=0, enable_confidence_head=False),
                       target=target, rngs=nnx.Rngs(0))
  assert bare.markov_w1 is None and bare.confidence_proj is None
  domino = build_drafter(CONFIGS["domino"], target=target, rngs=nnx.Rngs(0))
  assert domino.gru_w_ih.shape == (96, 32) and domino.gru_w_hh.shape == (96, 32)
  assert domino.correction_w1.shape == (16, 64) and domino.correction_w2.shape == (64, 16)
  # Export and load by path: same config, same weights (bf16 storage).
  for drafter in (dspark, domino):
    path = drafter_io.export_drafter(drafter, tmp_path / drafter.name, target_name="tiny")
    loaded = drafter_io.load_drafter(path, target=target)
    assert type(loaded) is type(drafter)
    assert loaded.drafter_config() == drafter.drafter_config()
    for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                              nnx.to_flat_state(nnx.state(loaded, nnx.Param))):
      assert p == q
      np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                 rtol=1e-2, atol=1e-2)


def test_defaults_for_the_real_target():
  config = draft_training.smollm2_shaped_config()
  d = draft_training.abstract_drafter({"kind": "dspark"}, config)
  assert d.block_size == 7 and d.drafter_config()["markov_rank"] == 256
  assert d.markov_w1.shape == (49152, 256) and d.confidence_proj.shape == (1, 576 + 256)
  d = draft_training.abstract_drafter({"kind": "domino"}, config)
  assert d.gru_w_hh.shape == (3 * 576, 576) and d.correction_w2.shape == (49152, 256)
