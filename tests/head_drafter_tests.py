"""Tests shared by the DSpark and Domino drafters (`test_dspark.py`, `test_domino.py`).

A test module imports these fixtures and tests and defines a module-scoped
`kind` fixture. Every greedy `generate` call of a module uses 3 (or 1)
held-out prompts, gamma 3, S_max 3, 40 new tokens and schedule "off", so the
gates and the drafter weights are array arguments of a few compiled programs.
The target is `tiny_target(seed=1, init_std=0.2)`, the learnable tiny target of
`test_objectives.py`.
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
import trainer_hooks
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.drafters import DominoDrafter, DSparkDrafter, Frozen, build_drafter
from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.models.transformer import tiny_target
from dloop_jax.training import hooks as hooks_lib
from dloop_jax.training import objectives
from dloop_jax.training import trainer as trainer_lib
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
# A shallow cost table (each extra token 10 % of a step) for the sampling test's scheduler.
SHALLOW_COSTS = {w: 1.0 + 0.1 * (w - 1) for w in range(1, 6)}


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
def drafters(learnable, kind):
  """Untrained and trained drafters of the module's kind (same config), and the training history."""
  target, batches, _ = learnable
  trained, history = _train(target, batches, CONFIGS[kind], objective=kind)
  untrained = build_drafter(CONFIGS[kind], target=target, rngs=nnx.Rngs(0))
  return {"untrained": untrained, "trained": trained, "history": history}


def _generate(target, prompts, **kw):
  kw.setdefault("mode", "dloop")
  kw.setdefault("lookup", "off")  # the drafter's own drafts
  return generate(target, prompts, max_new_tokens=40, block_size=GAMMA, max_stages=3,
                  schedule="off", **kw)


def _held_prompts(held, start, batch):
  return [h["prompt"] for h in held[start:start + batch]]


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("batch", [3])  # rows are independent; batch 1: test_engine_greedy
def test_greedy_lossless(learnable, drafters, kind, batch):
  target, _, held = learnable
  for start in (0, 3):  # two prompt sets
    prompts = _held_prompts(held, start, batch)
    ar = generate(target, prompts, max_new_tokens=40)
    for name in ("untrained", "trained"):
      drafter = drafters[name]
      # Gate +inf drafts one stage a round, as "sd" does (planned as DLoop with
      # S_max = 1: a program of its own, run for every kind by
      # tests/test_lossless_matrix.py).
      runs = [dict(gate=g) for g in (-math.inf, -0.5, math.inf)]
      for run in runs:
        out = _generate(target, prompts, drafter=drafter, **run)
        for p, want, got in zip(prompts, ar.tokens, out.tokens):
          assert len(got) == 40
          assert_same_or_near_tie(target, p, want, got)


def test_sampling_first_three_tokens(learnable, drafters, kind):
  """The first three tokens follow the target's distribution.

  Token 1 comes from the prefill, tokens 2 and 3 from verifying d_1 and d_2 of
  one stage, where d_2 is sampled from the head's distribution given d_1 (the
  Markov bias / the GRU state): the rejection rule must see exactly that q.
  The scheduler decides how many drafts to verify from c_k, under a cost table
  where those decisions vary here (the CPU table verifies nothing of the
  confidence head's, which rightly expects ~10 % acceptance at T = 1): for
  DSpark both from its confidence head and from its probabilities (one
  compiled program: the choice is a traced value).
  """
  target = learnable[0]
  sampling = SamplingConfig(temperature=1.0, top_k=4)
  prompt = [3, 14, 15]
  exact = reference.exact_distribution(target, prompt, sampling, depth=3)
  for confidence in (("drafter", "probability") if kind == "dspark" else ("auto",)):
    out = generate(target, [prompt] * 2000, max_new_tokens=3, mode="dloop",
                   drafter=drafters["trained"], block_size=2, gate=-math.inf, max_stages=2,
                   sampling=sampling, seed=12, draft_backoff=0, confidence=confidence,
                   costs=SHALLOW_COSTS)
    samples = [tuple(t[:3]) for t in out.tokens]
    assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3, confidence
    total = out.total
    # The decisions vary with c_k: some drafts are verified, others not.
    assert 0 < total.verified < total.drafted, (confidence, total.as_dict())


# ---------------------------------------------------- inference = training path
def _hidden(drafter, batch, n, num_stages):
  return nnx.jit(lambda d, b: d.train_stages(
      tokens=b["tokens"], features=b["features"], positions=b["positions"],
      segment_ids=b["segment_ids"], anchors=jnp.full((b["tokens"].shape[0], 1), n, jnp.int32),
      block_size=GAMMA, num_stages=num_stages))(drafter, jax.tree.map(jnp.asarray, batch))


def _head_logits(drafter, h, prev, head_rows=None):
  if isinstance(drafter, DSparkDrafter):
    return drafter.head_logits(h, prev, head_rows=head_rows)
  return drafter.corrected_logits(h, prev, head_rows=head_rows)[1]


def _rounding_tolerance(head_rows) -> float:
  """One rounding step of the head rows' dtype (bf16: 2^-8), at least f32 noise (1e-5)."""
  dtype = jnp.float32 if head_rows is None else head_rows.dtype
  return max(float(jnp.finfo(dtype).eps) / 2, 1e-5)


def test_draft_stage_matches_teacher_forced_heads(learnable, drafters, kind):
  """A stage's sequential head equals the training path's heads fed the stage's own drafts.

  Stage 1 from target context and a stage 2 from stand-in context (anchored at
  the ground-truth token, as in training), each against `train_stages` and the
  teacher-forced heads with prev = [anchor, d_1, .., d_{gamma-1}].
  """
  _, _, held = learnable
  # Exact with the layers read in their own dtype while drafting (the default
  # reads bf16 copies: `block.DRAFT_LAYER_DTYPE`).
  drafter = nnx.clone(drafters["trained"])
  drafter.draft_layer_dtype = None
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
    # With the head rows inference reads (bf16: `block.DRAFT_HEAD_DTYPE`).
    logits = _head_logits(drafter, hs[stage][:, 0], jnp.asarray(prev), state.head_rows)
    np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, -1)))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens)[..., None], -1)
    # The stage and the training path round their hidden states to the head
    # rows' dtype in other orders: one rounding of that dtype apart at most.
    atol = _rounding_tolerance(state.head_rows)
    np.testing.assert_allclose(drafted.logprobs, logp[..., 0], atol=atol)
    if kind == "dspark":
      conf = jax.nn.sigmoid(drafter.confidence_logit(hs[stage][:, 0], jnp.asarray(prev)))
      np.testing.assert_allclose(drafted.confidence, conf, atol=atol)
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


def test_training_raises_engine_acceptance_length(learnable, drafters, kind):
  target, _, held = learnable
  before = _tau(target, drafters["untrained"], held)
  after = _tau(target, drafters["trained"], held)
  print(f"\n{kind}: engine acceptance length {before:.3f} untrained -> {after:.3f} after"
        f" {STEPS} steps (train expected acceptance length"
        f" {_train_eal(drafters['history']):.3f})")
  assert before < 1.1
  assert after > before + 0.3


def _teacher_forced(drafter, batch, key):
  """Held-out stage-1 predictions: labels, valid, prev and hidden states [B, A, gamma, ...]."""
  b = objectives._batch(batch)  # pylint: disable=protected-access
  anchors, ok = objectives.sample_anchors(key, b, 16)
  (h,) = drafter.train_stages(tokens=b["tokens"], features=b["features"],
                              positions=b["positions"], segment_ids=b["segment_ids"],
                              anchors=anchors, block_size=GAMMA, num_stages=1)
  y = objectives._stage_targets(  # pylint: disable=protected-access
      b, anchors, ok, stage=0, gamma=GAMMA)
  return h, y


def _expected_acceptance(correct, valid):
  """1 + sum_k prod_{i<=k} acc_i over blocks whose k drafts all count (as the metric)."""
  c = np.asarray(correct & valid, np.float64)
  v = np.asarray(valid, np.float64)
  acc = c.sum((0, 1)) / np.maximum(v.sum((0, 1)), 1)
  return 1 + np.sum(np.cumprod(acc))


def test_loop_aware_objective(learnable, drafters, kind):
  """One loop-aware stage is the base objective; two stages train on stand-in context."""
  _, batches, _ = learnable
  drafter = drafters["trained"]
  batch = jax.tree.map(jnp.asarray, batches[1])
  key = jax.random.key(7)
  loss_of = nnx.jit(
      lambda d, b, k, cfg: objectives.loss_fn(d, b, k, objective=cfg[0], cfg=dict(cfg[1])),
      static_argnums=3)
  base, _ = loss_of(drafter, batch, key, (kind, tuple(TRAIN_CFG.items())))
  one, m1 = loss_of(drafter, batch, key, ("loop_aware", (("fixed_stages", 1),
                                                         ("anchors_per_sequence", 8))))
  two, m2 = loss_of(drafter, batch, key, ("loop_aware", (("fixed_stages", 2),
                                                         ("anchors_per_sequence", 8))))
  np.testing.assert_allclose(float(one), float(base), rtol=1e-5)
  assert float(m2["num_stages"]) == 2 and np.isfinite(float(two))
  assert float(m2["loss_last"]) != float(m2["loss_first"])


def test_export_and_load(learnable, kind, tmp_path):
  """Config round trip; export and load by path: same config, same weights (bf16 storage)."""
  target = learnable[0]
  drafter = build_drafter(CONFIGS[kind], target=target, rngs=nnx.Rngs(0))
  assert isinstance(drafter, DSparkDrafter if kind == "dspark" else DominoDrafter)
  resolved = json.loads(json.dumps(drafter.drafter_config()))
  assert build_drafter(resolved, target=target, rngs=nnx.Rngs(1)).drafter_config() == resolved
  frozen = {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(drafter, Frozen))}
  assert frozen <= {"embed", "lm_head"}
  # A draft vocabulary is a restriction after training (with_draft_vocab), which rebuilds
  # through build_drafter.
  assert build_drafter(dict(CONFIGS[kind], draft_vocab_size=32), target=target,
                       rngs=nnx.Rngs(0)).reduced_vocab
  path = drafter_io.export_drafter(drafter, tmp_path / kind, target_name="tiny")
  loaded = drafter_io.load_drafter(path, target=target)
  assert type(loaded) is type(drafter)
  assert loaded.drafter_config() == drafter.drafter_config()
  for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                            nnx.to_flat_state(nnx.state(loaded, nnx.Param))):
    assert p == q
    np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()),
                               rtol=1e-2, atol=1e-2)

# -------------------------------------------------------------------- trainer
def test_trainer_trains_the_tiny_config(kind, tmp_path, monkeypatch):
  """`python -m train --config configs/tiny_<kind>.py`, shortened: trains, exports, loads."""
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)
  c = trainer_hooks.load_config_file("tiny.py", kind)
  c.num_steps, c.log_every_steps, c.checkpoint.every_steps = 6, 3, 6
  c.data.num_examples, c.data.seq_len = 32, 32
  c.progress_bar = c.tensorboard = False
  result = trainer_lib.train(c, str(tmp_path))
  assert result.step == 6 and np.isfinite(result.metrics["loss"])
  if c.objective == "domino":
    # The trainer passes the progress: lambda = 1 - 2 * 5 / 6 at the last step (step 5), so 0.
    assert result.metrics["base_weight"] == 0.0
  else:
    assert 0 < result.metrics["confidence_mean"] < 1
  target = hooks_lib.default_build_target(c.target).model
  loaded = drafter_io.load_drafter(result.export_dir, target=target)
  assert loaded.drafter_config()["kind"] == c.drafter.kind
  out = generate(target, [[1, 2, 3]], max_new_tokens=8, mode="dloop", drafter=loaded,
                 block_size=2, max_stages=2, schedule="off")
  assert_same_or_near_tie(target, [1, 2, 3], generate(target, [[1, 2, 3]], max_new_tokens=8
                                                       ).tokens[0], out.tokens[0])

