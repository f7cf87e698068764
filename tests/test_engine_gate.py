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
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import generate
from dloop_jax.drafters import BlockDrafter, Eagle3Drafter, resolve_config

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
