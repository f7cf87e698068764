"""DLoop's confidence gate, and the statistics that follow the stages it lets through.

Engine runs share one shape (batch 2, gamma 2, S_max 3, 25 new tokens) so that
they share one compiled program; the gate is a traced value. They verify every
draft (schedule="off"): the scheduler, which may verify fewer, has its own
tests (test_engine_schedule.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import drafter_fixtures
from dloop_jax.decoding import calibration
from dloop_jax.decoding import engine
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import generate
from dloop_jax.drafters import BlockDrafter, Eagle3Drafter, resolve_config
from dloop_jax.errors import ConfigError

GAMMA, S_MAX, MAX_NEW = 2, 3, 25
P, Q = [5, 6, 7], [9, 1, 2, 3, 4]
# With this gate the perturbed drafter stops after 1, 2 or 3 stages (checked below).
MIXED_GATE = -2.0


@pytest.fixture(scope="module")
def drafters(tiny):
  return {
      "oracle": drafter_fixtures.oracle(tiny),
      "perturbed": drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3),
      "random": drafter_fixtures.random_drafter(tiny, seed=4),
  }


def _dloop(tiny, prompts, drafter, gate, **kw):
  return generate(tiny, prompts, max_new_tokens=MAX_NEW, mode="dloop", drafter=drafter,
                  block_size=GAMMA, gate=gate, max_stages=S_MAX, schedule="off",
                  **{"lookup": "off", **kw})  # the gate alone decides the stages


def _stages(row) -> int:
  """Stages drafted over all rounds of a row, from its stage histogram."""
  return sum(s * c for s, c in enumerate(row.stage_histogram))


# ----------------------------------------------------------------- unit tests


def test_stage_confidence_is_the_sum_over_the_stage():
  """conf_s is the sum of one stage's draft log-probabilities, per row, in f32."""
  logprobs = jnp.asarray([[-0.25, -0.25], [0.0, 0.0], [-3.0, -jnp.inf]])
  conf = gate_lib.stage_confidence(logprobs)
  assert conf.shape == (3,) and conf.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(conf), [-0.5, 0.0, -np.inf])
  half = gate_lib.stage_confidence(logprobs[:2].astype(jnp.bfloat16))
  assert half.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(half), [-0.5, 0.0])


def test_continue_drafting_rule():
  """`conf >= g` continues (equality included) until S_max stages; -inf / +inf gates; per row."""
  below = float(np.nextafter(np.float32(-0.5), np.float32(-1.0)))
  conf = jnp.asarray([-0.5, below, 0.0, -7.0], jnp.float32)

  def go(gate, stages_done, max_stages=3, c=conf):
    return np.asarray(gate_lib.continue_drafting(c, gate=gate, stages_done=stages_done,
                                                 max_stages=max_stages)).tolist()

  assert go(-0.5, 1) == [True, False, True, False]  # per row; equality continues
  assert go(-0.5, 2) == [True, False, True, False]
  assert go(-0.5, 3) == [False] * 4  # S_max stages drafted: verify
  assert go(-0.5, 1, max_stages=1) == [False] * 4
  assert go(-math.inf, 1) == [True] * 4
  assert go(-math.inf, 1, c=jnp.asarray([-jnp.inf])) == [True]  # -inf drafts S_max stages
  assert go(-math.inf, 3) == [False] * 4
  assert go(math.inf, 1, c=jnp.asarray([0.0, -jnp.inf])) == [False, False]
  # Per-row stage counts, and a traced gate (one compile for every g).
  per_row = jnp.asarray([1, 3, 2, 1])
  assert go(-10.0, per_row) == [True, False, True, True]
  traced = jax.jit(lambda c, g: gate_lib.continue_drafting(c, gate=g, stages_done=1,
                                                           max_stages=3))
  assert np.asarray(traced(conf, jnp.float32(-0.5))).tolist() == [True, False, True, False]
  assert np.asarray(traced(conf, jnp.float32(-7.0))).tolist() == [True, True, True, True]


# ------------------------------------------------------- gate semantics, end to end


@pytest.mark.parametrize("name", ["oracle", "random"])
def test_gate_minus_inf_drafts_s_max_stages_every_round(tiny, drafters, name):
  """g = -inf: every round drafts S_max stages, whatever the drafter's confidence."""
  out = _dloop(tiny, [P, Q], drafters[name], -math.inf)
  for row in out.rows:
    assert row.rounds > 0
    assert row.stage_histogram == [0] * S_MAX + [row.rounds]
    assert row.drafted == row.rounds * S_MAX * GAMMA
    assert row.target_tokens == row.rounds * (1 + S_MAX * GAMMA)
  if name == "oracle":
    # Everything accepted: each round commits S_max * gamma + 1 tokens.
    per_round = S_MAX * GAMMA + 1
    for row in out.rows:
      assert row.new_tokens == MAX_NEW
      assert row.rounds == math.ceil((MAX_NEW - 1) / per_round)
      assert row.accepted == MAX_NEW - 1 - (row.rounds - 1)  # the last round is cut short


@pytest.mark.parametrize("name", ["oracle", "perturbed"])
def test_gate_plus_inf_is_speculative_decoding(tiny, drafters, name):
  """g = +inf: one stage per round; tokens and every statistic equal mode "sd"."""
  prompts = [P, Q]
  loop = _dloop(tiny, prompts, drafters[name], math.inf)
  sd = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode="sd", drafter=drafters[name],
                block_size=GAMMA, schedule="off")
  assert loop.tokens == sd.tokens
  for a, b in zip(loop.rows, sd.rows):
    assert a.stage_histogram == [0, a.rounds] + [0] * (S_MAX - 1)
    assert b.stage_histogram == [0, b.rounds]
    assert ({**dataclasses.asdict(a), "stage_histogram": None}
            == {**dataclasses.asdict(b), "stage_histogram": None})
    assert a.target_tokens == a.rounds * (1 + GAMMA)


# --------------------------------------------- statistics follow the stages drafted


def test_verify_width_follows_the_stages_drafted(tiny, drafters):
  """Verification reads 1 + s * gamma tokens for the most stages s any active row drafted.

  Every row active in a round is charged that round's (shared) width, so:
    * each row pays at least its own need sum_r (1 + s_r gamma), exactly that
      when the rows draft alike, and less than rounds * (1 + S_max gamma) when
      the gate stops early;
    * rows with equal rounds pay the same; a row with more rounds pays what the
      shorter one paid plus 1 + gamma .. 1 + S_max gamma per extra round.
  """
  drafter = drafters["perturbed"]
  twin = _dloop(tiny, [P, P], drafter, MIXED_GATE)
  a, b = twin.rows
  assert a == b
  hist = a.stage_histogram
  assert hist[1] > 0 and sum(hist[2:]) > 0, hist  # the gate both stops and continues
  assert a.drafted == GAMMA * _stages(a)
  assert a.target_tokens == a.rounds + GAMMA * _stages(a)
  assert a.target_tokens < a.rounds * (1 + S_MAX * GAMMA)

  out = _dloop(tiny, [P, Q], drafter, MIXED_GATE)
  assert out.tokens[0] == twin.tokens[0]
  assert out.rows[0].stage_histogram == hist  # a row's stages do not depend on the others
  for row in out.rows:
    need = row.rounds + GAMMA * _stages(row)
    assert need <= row.target_tokens <= row.rounds * (1 + S_MAX * GAMMA)
  short, long = sorted(out.rows, key=lambda r: r.rounds)
  extra = long.rounds - short.rounds
  diff = long.target_tokens - short.target_tokens
  assert extra * (1 + GAMMA) <= diff <= extra * (1 + S_MAX * GAMMA)
  # These two rows stop at different stages in some shared round: the shorter
  # one is verified wider than it needs.
  assert extra > 0 and short.target_tokens > short.rounds + GAMMA * _stages(short)


class _Counter:
  """Counts drafter forwards as the compiled program runs them (batch 1)."""

  def __init__(self):
    self.n = 0

  def tick(self):
    self.n += 1


class _CountingEagle3(Eagle3Drafter):
  """EAGLE-3 that counts its layer forwards (commit and every step go through `_forward_cached`)."""

  counter = _Counter()

  def _forward_cached(self, state, tokens, feature, starts):
    jax.debug.callback(self.counter.tick)
    return super()._forward_cached(state, tokens, feature, starts)


class _CountingBlock(BlockDrafter):
  """Block drafter that counts commits and stages (one forward each)."""

  counter = _Counter()

  def commit(self, state, **kw):
    jax.debug.callback(self.counter.tick)
    return super().commit(state, **kw)

  def draft_stage(self, state, **kw):
    jax.debug.callback(self.counter.tick)
    return super().draft_stage(state, **kw)


@pytest.mark.parametrize("cls", [_CountingEagle3, _CountingBlock], ids=["eagle3", "block"])
def test_drafter_forwards_are_counted_exactly(tiny, cls):
  """drafter_forwards equals the forwards the drafter ran and the hand count.

  Hand count, for an untrained drafter whose drafts are all rejected: 1 commit
  after the prefill, and per drafting round
    EAGLE-3: gamma - 1 forwards for the first stage, gamma for each later one
             (it first reads the previous stage's pending draft), so s * gamma - 1;
    block:   one forward per stage, so s;
  plus 1 at the start of every drafting round but the first, which reads the
  tokens committed since the last (`decoding.deferred`): no round accepts a
  draft, so none commits at once, and a pause's rounds run no drafter forward.
  """
  kind = "eagle3" if cls is _CountingEagle3 else "block"
  drafter = cls(resolve_config({"kind": kind, "block_size": 4}, tiny.config), target=tiny,
                rngs=nnx.Rngs(0))
  for backoff in (0, 8):
    drafter.counter.n = 0
    out = generate(tiny, [Q], max_new_tokens=MAX_NEW, mode="dloop", drafter=drafter,
                   block_size=GAMMA, gate=-4.0, max_stages=S_MAX, draft_backoff=backoff)
    row = out.rows[0]
    if backoff:
      assert row.stage_histogram[0] > 0, row.stage_histogram
    else:
      assert row.stage_histogram[1] > 0 and row.stage_histogram[S_MAX] > 0, row.stage_histogram
    assert row.accepted == 0
    per_round = [(s * GAMMA - 1) if kind == "eagle3" else s for s in range(1, S_MAX + 1)]
    drafting = row.stage_histogram[1:]
    hand = 1 + sum(c * n for c, n in zip(drafting, per_round)) + sum(drafting) - 1
    assert row.drafter_forwards == hand
    assert drafter.counter.n == hand


# ------------------------------------------------------------ gate="auto"


def _table(*, full, accepted, next_accepted, block_size=GAMMA, score="probability"):
  """A calibration with the same values in every bin (arrays broadcast to [2, bins])."""
  shape = (len(calibration.ROWS), calibration.NUM_BINS)
  fill = lambda x: np.broadcast_to(np.asarray(x, np.float64), shape).copy()  # noqa: E731
  return calibration.Calibration(
      block_size=block_size, score=score, count=fill(10), full=fill(full), full_se=fill(0),
      accepted=fill(accepted), accepted_se=fill(0), next_count=fill(10),
      next_accepted=fill(next_accepted), next_accepted_se=fill(0))


def test_calibrated_rule_against_a_hand_computed_round():
  """Another stage iff gain / (d + v(s+1) - v(s)) > T_s / C_s, by hand.

  d = 0.2, v = (1.0, 1.7, 2.1, 2.3). Stage 1 scores -1.2 (bin [-1.5, -1)):
  full 0.5, accepted 2.5, so reach 0.5 and T_1 = 1 + 2.5 = 3.5 over C_1 =
  0.2 + 1.7 = 1.9 (1.842 tokens per unit); another stage costs 0.2 + 0.4 =
  0.6. next_accepted 2.0 gains 0.5 x 2.0 = 1.0: 1.667 per unit, stop;
  2.4 gains 1.2: 2.0 per unit, draft.
  """
  b = calibration.bin_of(-1.2)
  assert calibration.EDGES[b - 1] == -1.5 and calibration.EDGES[b] == -1.0

  def first_stage(next_accepted):
    table = _table(full=0.1, accepted=0.0, next_accepted=0.0, block_size=4)
    for name, value in (("full", 0.5), ("accepted", 2.5), ("next_accepted", next_accepted)):
      getattr(table, name)[0, b] = value
    gate = gate_lib.Gate.create(max_stages=3, table=table, stage_cost=0.2,
                                verify_cost=[1.0, 1.7, 2.1, 2.3])
    more, outlook = gate_lib.calibrated_continue(
        gate, gate_lib.Outlook.start(2), score=jnp.asarray([-1.2, -7.0]), stages_done=1)
    return np.asarray(more).tolist(), outlook, gate

  more, outlook, _ = first_stage(2.0)
  assert more == [False, False]
  np.testing.assert_allclose(np.asarray(outlook.reach), [0.5, 0.1], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(outlook.tokens), [3.5, 1.0], rtol=1e-6)
  more, outlook, gate = first_stage(2.4)
  assert more == [True, False]  # the -7.0 row's bin promises nothing

  # Stage 2 reads the looped row: full 0.8, accepted 3.0, next 3.5 at its
  # score -0.5 (bin [-0.6, -0.3)). reach 0.5 x 0.8 = 0.4, T_2 = 3.5 + 0.5 x 3 =
  # 5.0, C_2 = 0.4 + 2.1 = 2.5 (2.0 per unit); gain 0.4 x 3.5 = 1.4 over
  # 0.2 + 0.2 = 0.4: 3.5 per unit, draft.
  b2 = calibration.bin_of(-0.5)
  for name, value in (("full", 0.8), ("accepted", 3.0), ("next_accepted", 3.5)):
    gate = gate.replace(**{name: getattr(gate, name).at[1, b2].set(value)})
  more2, outlook2 = gate_lib.calibrated_continue(gate, outlook, score=jnp.asarray([-0.5, -0.5]),
                                                 stages_done=2)
  np.testing.assert_allclose(np.asarray(outlook2.tokens)[0], 5.0, rtol=1e-6)
  assert np.asarray(more2).tolist()[0]
  # The same stage with the next verification 1.2 wider: 1.4 / 1.4 = 1 < 2, stop.
  dearer = gate.replace(verify_cost=jnp.asarray([1.0, 1.7, 2.1, 3.3]))
  assert not np.asarray(gate_lib.calibrated_continue(
      dearer, outlook, score=jnp.asarray([-0.5, -0.5]), stages_done=2)[0])[0]
  # decide(): S_max caps it, and a threshold gate ignores the table.
  assert not np.asarray(gate_lib.decide(gate, outlook, score=jnp.asarray([-0.5, -0.5]),
                                        learned_score=None, stages_done=3, max_stages=3)[0]).any()
  fixed = gate_lib.Gate.create(threshold=-1.0, max_stages=3)
  assert np.asarray(gate_lib.decide(fixed, outlook, score=jnp.asarray([-0.5, -1.5]),
                                    learned_score=None, stages_done=1,
                                    max_stages=3)[0]).tolist() == [True, False]


def test_auto_gate_follows_the_table_and_the_costs_without_recompiling(tiny, drafters):
  """End to end: with a stage that gains gamma and adds nothing to what the round already
  expects (T stays 1), flat costs draft S_max stages every round (g = -inf's tokens and
  stages), a steep verification stops after one (g = +inf's), a table that promises nothing
  stops too; all three run one compiled program."""
  drafter = drafters["perturbed"]
  gains = _table(full=1.0, accepted=0.0, next_accepted=GAMMA)
  flat = {1: 1.0, 1 + S_MAX * GAMMA: 1.0}
  steep = {1: 1.0, 1 + GAMMA: 1.0, 1 + 2 * GAMMA: 200.0, 1 + 3 * GAMMA: 400.0}
  every = _dloop(tiny, [P, Q], drafter, "auto", calibration=gains, costs=flat)
  traces = engine._TRACE_COUNT
  assert every.gate == "auto"
  assert every.tokens == _dloop(tiny, [P, Q], drafter, -math.inf).tokens
  for row in every.rows:
    assert row.stage_histogram == [0] * S_MAX + [row.rounds]
  one = _dloop(tiny, [P, Q], drafter, "auto", calibration=gains, costs=steep)
  none = _dloop(tiny, [P, Q], drafter, "auto", costs=flat,
                calibration=_table(full=1.0, accepted=0.0, next_accepted=0.0))
  plus = _dloop(tiny, [P, Q], drafter, math.inf)
  for out in (one, none):
    assert out.tokens == plus.tokens
    for row in out.rows:
      assert row.stage_histogram == [0, row.rounds] + [0] * (S_MAX - 1)
  assert engine._TRACE_COUNT == traces + 0  # -inf / +inf and every table: one program


def test_auto_gate_needs_a_calibration(tiny, drafters):
  with pytest.raises(ConfigError, match="calibration table.*python -m train.calibrate"):
    _dloop(tiny, [P], drafters["perturbed"], "auto", costs={1: 1.0, 7: 1.0})
  with pytest.raises(ConfigError, match="gate must be a number"):
    _dloop(tiny, [P], drafters["perturbed"], "often")
