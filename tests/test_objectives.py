"""Training objectives: shapes, masking, jit, learning, and the engine-measured effect.

The training-effect tests use `tiny_target(seed=1, init_std=0.2)`: the default
tiny target (init_std 0.3) continues random prompts almost chaotically (a
bigram table of 20k response tokens predicts 23 % of held-out tokens, and
drafters plateau near that), which leaves little for a drafter to learn; at
init_std 0.2 the same table predicts ~50 % and trained drafters reach
acceptance lengths of 1.5-1.7 against ~1.03 untrained.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
from dloop_jax.decoding import generate
from dloop_jax.drafters import build_drafter
from dloop_jax.errors import ConfigError
from dloop_jax.models.transformer import tiny_target
from dloop_jax.training import objectives
from dloop_jax.training.metrics import expected_acceptance_length

GAMMA = 3
CASES = {
    "eagle3_ttt": ("eagle3", {"ttt_steps": GAMMA}),
    "block": ("block", {"anchors_per_sequence": 8}),
    "loop_eagle3": ("eagle3", {"loop_stages": 2}),
    "loop_block": ("block", {"loop_stages": 3, "anchors_per_sequence": 8}),
}


def _objective(case: str) -> str:
  return "loop_aware" if case.startswith("loop") else case


def _drafter(target, kind, seed=0):
  return build_drafter({"kind": kind, "block_size": GAMMA}, target=target, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def examples(tiny):
  return draft_training.make_examples(tiny, taps=(0, 1), num_prompts=32, max_new_tokens=24,
                                      seed=0)


@pytest.fixture(scope="module")
def packed(examples):
  """Rows of two packed examples, padded: [prompt+response | prompt+response | pad]."""
  return draft_training.pack_batch(examples[:8], seq_len=72, per_row=2)


def _jit_loss(drafter, objective, cfg):
  graphdef, state = nnx.split(drafter)

  @jax.jit
  def fn(state, batch, key):
    return objectives.loss_fn(nnx.merge(graphdef, state), batch, key, objective=objective,
                              cfg=cfg)

  return lambda batch, key: fn(state, jax.tree.map(jnp.asarray, batch), key)


@pytest.mark.parametrize("case", list(CASES))
def test_shapes_metrics_and_masks(tiny, packed, case):
  kind, cfg = CASES[case]
  loss_of = _jit_loss(_drafter(tiny, kind), _objective(case), cfg)
  key = jax.random.key(3)
  loss, metrics = loss_of(packed, key)
  assert loss.shape == () and np.isfinite(float(loss))
  accs = [float(metrics[f"acc_{k}"]) for k in range(1, GAMMA + 1)]
  assert all(0 <= a <= 1 for a in accs) and "acc_4" not in metrics
  np.testing.assert_allclose(float(metrics["expected_acceptance_length"]),
                             1 + np.sum(np.cumprod(accs)), rtol=1e-5)
  if case.startswith("loop"):
    assert 1 <= float(metrics["num_stages"]) <= cfg["loop_stages"]
    np.testing.assert_allclose(float(loss), 0.5 * float(metrics["loss_first"] + metrics["loss_last"]),
                               rtol=1e-5)

  # Padding (segment 0) holds junk: nothing changes.
  junk = {k: v.copy() for k, v in packed.items()}
  pad = junk["segment_ids"] == 0
  assert pad.any()
  junk["tokens"][pad] = 7
  junk["features"][pad] = 3.0
  np.testing.assert_allclose(loss_of(junk, key)[0], loss, rtol=1e-6)

  # Tokens after the loss region of the second example: nothing changes.
  after = {k: v.copy() for k, v in packed.items()}
  for r in range(after["tokens"].shape[0]):
    idx = np.nonzero(after["segment_ids"][r] == 2)[0]
    tail = idx[-3:]
    after["loss_mask"][r, tail] = 0
  base = loss_of(after, key)[0]
  for r in range(after["tokens"].shape[0]):
    tail = np.nonzero(after["segment_ids"][r] == 2)[0][-3:]
    after["tokens"][r, tail] = (after["tokens"][r, tail] + 5) % 64
    after["features"][r, tail] += 1.0
  np.testing.assert_allclose(loss_of(after, key)[0], base, rtol=1e-6)

  # The first example of a row, out of the loss: the second one's loss is unchanged,
  # so attention does not cross segments.
  other = {k: v.copy() for k, v in packed.items()}
  other["loss_mask"][other["segment_ids"] == 1] = 0
  base = loss_of(other, key)[0]
  first = other["segment_ids"] == 1
  other["tokens"][first] = (other["tokens"][first] * 7 + 1) % 64
  other["features"][first] = -other["features"][first]
  np.testing.assert_allclose(loss_of(other, key)[0], base, rtol=1e-6)


def test_loop_aware_with_one_stage_is_the_base_objective(tiny, packed):
  key = jax.random.key(0)
  for kind, base, cfg in (("eagle3", "eagle3_ttt", {"ttt_steps": GAMMA}),
                          ("block", "block", {"anchors_per_sequence": 8})):
    drafter = _drafter(tiny, kind)
    want = _jit_loss(drafter, base, cfg)(packed, key)[0]
    got = _jit_loss(drafter, "loop_aware", dict(cfg, fixed_stages=1))(packed, key)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_random_stage_count_is_traced(tiny, packed):
  loss_of = _jit_loss(_drafter(tiny, "block"), "loop_aware", {"loop_stages": 3})
  stages = {int(loss_of(packed, jax.random.key(i))[1]["num_stages"]) for i in range(12)}
  assert stages == {1, 2, 3}


def test_feature_noise_is_relative_and_its_own_stream(tiny, packed):
  features = jax.random.normal(jax.random.key(1), (4, 9, 2, 64)) * jnp.array([1.0, 300.0])[:, None]
  noisy = objectives.noisy_features(features, jax.random.key(2), scale=0.1)
  rms = lambda x: np.sqrt(np.mean(np.square(np.asarray(x)), axis=(0, 1, 3)))
  # Each tap's noise is a tenth of its own size, however large the tap.
  np.testing.assert_allclose(rms(noisy - features) / rms(features), [0.1, 0.1], rtol=0.1)
  drafter = _drafter(tiny, "block")
  cfg = {"anchors_per_sequence": 8}
  key = jax.random.key(0)
  clean = _jit_loss(drafter, "block", cfg)(packed, key)
  assert _jit_loss(drafter, "block", dict(cfg, feature_noise=0.0))(packed, key)[0] == clean[0]
  loss_of = _jit_loss(drafter, "block", dict(cfg, feature_noise=0.5))
  noised = loss_of(packed, key)
  assert noised[0] != clean[0] and loss_of(packed, key)[0] == noised[0]
  with pytest.raises(ConfigError, match="feature_noise must be a number >= 0"):
    objectives.loss_fn(drafter, packed, key, objective="block", cfg={"feature_noise": -0.1})


def test_bad_objectives_raise(tiny, packed):
  drafter = _drafter(tiny, "block")
  with pytest.raises(ConfigError, match="does not train"):
    objectives.loss_fn(drafter, packed, jax.random.key(0), objective="eagle3_ttt", cfg={})
  with pytest.raises(ConfigError, match="base_objective"):
    objectives.loss_fn(drafter, packed, jax.random.key(0), objective="loop_aware",
                       cfg={"base_objective": "eagle3_ttt"})
  with pytest.raises(ConfigError, match="objective must be"):
    objectives.loss_fn(drafter, packed, jax.random.key(0), objective="mtp", cfg={})


def test_expected_acceptance_length():
  np.testing.assert_allclose(expected_acceptance_length(jnp.array([0.5, 0.5, 1.0])), 2.0)
  np.testing.assert_allclose(expected_acceptance_length(jnp.zeros(4)), 1.0)


# The base objectives' learning is checked where it matters, by the engine
# (test_training_raises_engine_acceptance_length); the loop-aware ones here.
@pytest.mark.parametrize("case", ["loop_eagle3", "loop_block"])
def test_loss_decreases(tiny, examples, case):
  kind, cfg = CASES[case]
  batches = [draft_training.pack_batch(examples[i:i + 8], seq_len=48, per_row=1)
             for i in range(0, len(examples), 8)]
  history = draft_training.train(_drafter(tiny, kind), batches, objective=_objective(case),
                                 cfg=cfg, steps=100)
  losses = np.array([h["loss"] for h in history])
  if case.startswith("loop"):
    # Loss scales with the random stage count: compare the first stage's loss.
    losses = np.array([h["loss_first"] for h in history])
  assert losses[-20:].mean() < 0.8 * losses[:10].mean(), losses[::10]


# --------------------------------------------------------- the training effect
@pytest.fixture(scope="module")
def learnable():
  target = tiny_target(seed=1, init_std=0.2)
  train = draft_training.make_examples(target, taps=(0, 1), num_prompts=256, max_new_tokens=40,
                                       seed=0)
  held = draft_training.make_examples(target, taps=(0, 1), num_prompts=16, max_new_tokens=40,
                                      seed=99)
  batches = [draft_training.pack_batch(train[i:i + 16], seq_len=48)
             for i in range(0, len(train), 16)]
  return target, batches, held


def _tau(target, drafter, held, **kw):
  # Drafter quality: every draft verified, every round drafting (the method as stated),
  # the drafter's own drafts only (no prompt lookup).
  kw.setdefault("schedule", "off")
  kw.setdefault("lookup", "off")
  out = generate(target, [h["prompt"] for h in held], max_new_tokens=40, drafter=drafter,
                 block_size=GAMMA, **kw)
  return out.total


# kind -> (its base objective, cfg): the CASES that are not loop-aware.
BASE_OBJECTIVES = {kind: (case, cfg) for case, (kind, cfg) in CASES.items()
                   if not case.startswith("loop")}


@pytest.fixture(scope="module")
def trained(learnable):
  """`trained(kind)`: (drafter, history) after 150 steps of the kind's base objective on the
  learnable target, trained once per module (tests that change it take a clone)."""
  target, batches, _ = learnable
  done = {}

  def get(kind):
    if kind not in done:
      objective, cfg = BASE_OBJECTIVES[kind]
      drafter = _drafter(target, kind)
      history = draft_training.train(drafter, batches, objective=objective, cfg=cfg, steps=150)
      done[kind] = (drafter, history)
    return done[kind]

  return get


@pytest.mark.parametrize("kind", list(BASE_OBJECTIVES))
def test_training_raises_engine_acceptance_length(learnable, trained, kind):
  target, _, held = learnable
  before = _tau(target, _drafter(target, kind), held, mode="sd").acceptance_length
  drafter, history = trained(kind)
  after = _tau(target, drafter, held, mode="sd").acceptance_length
  loop = _tau(target, drafter, held, mode="dloop", gate=-1.0, max_stages=3)
  print(f"\n{kind}: sd acceptance length {before:.3f} untrained -> {after:.3f} after 150 steps"
        f" (train expected_acceptance_length {history[-1]['expected_acceptance_length']:.3f});"
        f" dloop g=-1 S_max=3: {loop.acceptance_length:.3f}, {loop.stages_per_round:.2f}"
        " stages/round")
  assert before < 1.1
  assert after > before + 0.3


def test_loop_aware_fine_tune_lowers_the_last_stage_loss(learnable, trained):
  """Loop-aware fine-tuning learns to draft from the stand-in context of earlier stages."""
  _, batches, held = learnable
  drafter = nnx.clone(trained("block")[0])
  eval_cfg = {"loop_stages": 2, "fixed_stages": 2, "anchors_per_sequence": 8}
  held_batch = draft_training.pack_batch(held, seq_len=48)
  before = _jit_loss(drafter, "loop_aware", eval_cfg)(held_batch, jax.random.key(0))[1]
  draft_training.train(drafter, batches, objective="loop_aware",
                       cfg={"loop_stages": 2, "anchors_per_sequence": 8}, steps=60,
                       learning_rate=1e-3, seed=1)
  after = _jit_loss(drafter, "loop_aware", eval_cfg)(held_batch, jax.random.key(0))[1]
  print(f"\nblock stage-2 loss {float(before['loss_last']):.3f} -> {float(after['loss_last']):.3f},"
        f" stage-2 expected acceptance {float(before['last_expected_acceptance_length']):.3f} ->"
        f" {float(after['last_expected_acceptance_length']):.3f}")
  assert float(after["loss_last"]) < float(before["loss_last"])


def _loop_aware_against_base(kind: str, *, init_std: float, seed: int, base_steps: int = 1500,
                             held_prompts: int = 96) -> dict[str, dict]:
  """The loop-aware effect under equal training: same start, same number of extra steps.

  The drafter first trains `base_steps` (1,500 in the measurement) steps of its
  base objective (Adam 3e-3, 1,024 prompts: near its plateau), then 400 more
  steps at 3e-4 of either the base or the loop-aware objective (S ~ U{1..3})
  from that same start. Returns the engine-measured acceptance length on
  `held_prompts` (96 in the measurement) held-out prompts of `sd` and of
  `dloop` (S_max 3) at g = -inf (every round drafts 3 stages), -1.5 and -0.5,
  for "start", "base" and "loop_aware".
  """
  target = tiny_target(seed=1, init_std=init_std)
  train = draft_training.make_examples(target, taps=(0, 1), num_prompts=1024, max_new_tokens=40,
                                       seed=100 + seed)
  held = draft_training.make_examples(target, taps=(0, 1), num_prompts=held_prompts,
                                      max_new_tokens=40,
                                      seed=99)
  batches = [draft_training.pack_batch(train[i:i + 16], seq_len=48)
             for i in range(0, len(train), 16)]
  base, cfg = BASE_OBJECTIVES[kind]
  loop_cfg = dict(cfg, loop_stages=3)  # (loop-aware unrolls its own stages: ttt_steps unused)
  drafter = _drafter(target, kind, seed=seed)
  draft_training.train(drafter, batches, objective=base, cfg=cfg, steps=base_steps,
                       learning_rate=3e-3, seed=1000 * seed)
  start = jax.tree.map(lambda x: x, nnx.state(drafter, nnx.Param))

  def measure():
    row = {"sd": _tau(target, drafter, held, mode="sd").acceptance_length}
    for gate in (-np.inf, -1.5, -0.5):
      t = _tau(target, drafter, held, mode="dloop", gate=gate, max_stages=3)
      row[f"dloop g={gate}"] = t.acceptance_length
      row[f"stages g={gate}"] = t.stages_per_round
    return row

  results = {"start": measure()}
  for name, objective, objective_cfg in (("base", base, cfg),
                                         ("loop_aware", "loop_aware", loop_cfg)):
    nnx.update(drafter, start)
    draft_training.train(drafter, batches, objective=objective, cfg=objective_cfg, steps=400,
                         learning_rate=3e-4, seed=1000 * seed + 1)
    results[name] = measure()
  for name, row in results.items():
    print(f"\n{kind} init_std={init_std} seed={seed} {name}: "
          + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
  return results


@pytest.mark.skipif(not os.environ.get("DLOOP_MEASURE"),
                    reason="trains 1,600 steps (about two minutes on two cores); the default suite"
                    " checks the objective itself (test_loop_aware_fine_tune_lowers_the_last_stage"
                    "_loss): set DLOOP_MEASURE=1")
def test_loop_aware_fine_tune_raises_dloop_acceptance_length():
  """On a predictable target, where whole stages get accepted, loop-aware fine-tuning raises
  DLoop's acceptance length above the same number of extra base-objective steps."""
  # Lighter than the measured protocol (docs/drafters.md): a shorter base run, half the
  # held-out prompts.
  r = _loop_aware_against_base("eagle3", init_std=0.05, seed=0, base_steps=800, held_prompts=48)
  inf = f"dloop g={-np.inf}"
  assert r["loop_aware"][inf] > r["base"][inf] > r["start"][inf]
  assert r["loop_aware"]["dloop g=-1.5"] > r["base"]["dloop g=-1.5"]
  # DLoop itself: far above one stage per round.
  assert r["loop_aware"][inf] > r["loop_aware"]["sd"] + 0.5


@pytest.mark.skipif(not os.environ.get("DLOOP_MEASURE"),
                    reason="a measurement (minutes), not a check: set DLOOP_MEASURE=1")
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("init_std", [0.05, 0.1])
@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_measure_loop_aware_effect_on_dloop(kind, init_std, seed):
  """The table of docs/drafters.md: `-s` prints every row."""
  r = _loop_aware_against_base(kind, init_std=init_std, seed=seed)
  # Looping itself raises the acceptance length of every drafter here.
  for row in r.values():
    assert row[f"dloop g={-np.inf}"] > row["sd"]
