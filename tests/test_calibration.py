"""Drafter calibration tables: binning, JSON, the teacher-forced measurement, exports."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import drafter_fixtures
from dloop_jax.decoding import calibration
from dloop_jax.decoding.sampling import GREEDY
from dloop_jax.drafters import build_drafter
from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.training import calibration as measuring

GAMMA = 3
STOP = 56  # ends some of the tiny target's answers early: rows of several lengths


# ------------------------------------------------------------------ binning
def test_from_samples_hand_computed():
  """Counts, shrunk means and the rule: a stage counts only after full earlier stages."""
  hi, mid = -0.1, -5.0  # bins 10 and 3
  scores = np.array([[hi, hi, hi], [hi, mid, hi], [mid, hi, hi], [hi, hi, hi], [hi, hi, hi]])
  accepted = np.array([[2, 2, 1],     # full, full, 1
                       [2, 0, 2],     # the third stage is not reached: not counted
                       [1, 2, 2],     # stops after the first
                       [2, -1, -1],   # the answer ends: nothing after
                       [-1, -1, -1]])  # nothing measured
  t = calibration.from_samples(scores=scores, accepted=accepted, block_size=2,
                               score="probability", source="hand")
  assert list(calibration.bin_of([hi, mid, -20.0, -0.3, -12.0])) == [10, 3, 0, 10, 1]
  p = calibration.PRIOR
  # First row: bin 10 holds 2, 2, 2; bin 3 holds 1. Pooled: P(full) 3/4, E(acc) 7/4;
  # following stages measured after bin 10's full stages: 2 and 0 (pooled 1).
  np.testing.assert_array_equal(t.count[0], [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3])
  np.testing.assert_array_equal(t.next_count[0], [0] * 10 + [2])
  np.testing.assert_allclose(t.full[0, [10, 3, 0]], [(3 + p * .75) / (3 + p),
                                                      (0 + p * .75) / (1 + p), .75])
  np.testing.assert_allclose(t.accepted[0, [10, 3, 0]], [(6 + p * 1.75) / (3 + p),
                                                          (1 + p * 1.75) / (1 + p), 1.75])
  np.testing.assert_allclose(t.next_accepted[0, [10, 3]], [(2 + p) / (2 + p), 1.0])
  np.testing.assert_allclose(t.full_se[0, 10], math.sqrt(t.full[0, 10] * (1 - t.full[0, 10]) / 3))
  assert t.accepted_se[0, 10] == 0.0
  np.testing.assert_allclose(t.next_accepted_se[0, 10], np.std([2, 0], ddof=1) / math.sqrt(2))
  # Looped row: bin 10 holds 2 (position 0's second stage) and 1 (its third); bin 3 holds 0.
  # Pooled: P(full) 1/3, E(acc) 1; after bin 10's full stage: 1.
  np.testing.assert_array_equal(t.count[1], [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2])
  np.testing.assert_array_equal(t.next_count[1], [0] * 10 + [1])
  np.testing.assert_allclose(t.full[1, [10, 3]], [(1 + p / 3) / (2 + p), (p / 3) / (1 + p)])
  np.testing.assert_allclose(t.accepted[1, [10, 3]], [(3 + p) / (2 + p), p / (1 + p)])
  np.testing.assert_allclose(t.next_accepted[1, [10, 3]], [(1 + p) / (1 + p), 1.0])
  assert "| [-0.3, 0) | looped | 2 |" in t.format()


def test_from_samples_missing_rows():
  """No looped stage measured: the first row's estimates, counted 0. No stage measured after
  the looped row's full stages: they are assumed to yield the looped row's mean."""
  one = calibration.from_samples(scores=[[-0.1], [-5.0]], accepted=[[2], [1]], block_size=2,
                                 score="probability")
  np.testing.assert_array_equal(one.count[1], 0)
  np.testing.assert_array_equal(one.next_count[1], 0)
  np.testing.assert_allclose(one.full[1], one.full[0])
  np.testing.assert_allclose(one.next_accepted, 0.0)  # nothing says more
  two = calibration.from_samples(scores=[[-0.1, -0.1], [-0.1, -0.1]], accepted=[[2, 2], [2, 1]],
                                 block_size=2, score="probability")
  np.testing.assert_allclose(two.next_accepted[1], 1.5)


# --------------------------------------------------------------------- JSON
def _table(score="probability"):
  rng = np.random.default_rng(0)
  accepted = rng.integers(0, 4, size=(64, 3))
  return calibration.from_samples(scores=-rng.exponential(3.0, size=(64, 3)), accepted=accepted,
                                  block_size=3, score=score, source="random")


def test_json_round_trip_and_errors(tmp_path):
  t = _table()
  back = calibration.Calibration.from_json(json.loads(json.dumps(t.to_json())))
  assert (back.block_size, back.score, back.source) == (3, "probability", "random")
  for name in ("count", "full", "full_se", "accepted", "accepted_se", "next_count",
               "next_accepted", "next_accepted_se"):
    np.testing.assert_allclose(getattr(back, name), getattr(t, name), atol=1e-6)
  path = tmp_path / "table.json"
  path.write_text(json.dumps(t.to_json()))
  assert set(calibration.load(path)) == {"probability/gamma3"}
  good = t.to_json()
  bad = {
      "shape": dict(good, full=good["full"][:1]),
      "value": dict(good, full=[[2.0] * calibration.NUM_BINS] * 2),
      "type": dict(good, accepted="many"),
      "block size": dict(good, block_size="three"),
      "edges": dict(good, edges=[-1.0, 0.0]),
      "format": dict(good, format="something else"),
      "missing": {k: v for k, v in good.items() if k != "next_accepted"},
  }
  for what, data in bad.items():
    with pytest.raises(ConfigError):
      calibration.Calibration.from_json(data)
    with pytest.raises(ConfigError):
      calibration.tables_from_json({"probability": data})
    del what
  # Tables are named by their score and gamma, whatever their key.
  assert set(calibration.tables_from_json({"any": good})) == {"probability/gamma3"}
  with pytest.raises(ConfigError):
    calibration.tables_from_json([good])


# -------------------------------------------------------------- measurement
@pytest.fixture(scope="module")
def setup(tiny):
  rng = np.random.default_rng(0)
  prompts = [[int(x) for x in rng.integers(3, 64, size=int(rng.integers(3, 12)))]
             for _ in range(6)]
  answers = measuring.answers(tiny, prompts, max_new_tokens=24, stop_tokens=(STOP,),
                              batch_size=4)
  return tiny, prompts, answers


def test_answers_are_greedy_and_stop(setup):
  target, prompts, answers = setup
  assert all(1 <= len(a) <= 24 for a in answers)
  assert len({len(a) for a in answers}) > 2  # the stop token ends some early
  for a in answers:
    assert STOP not in a[:-1] and (len(a) == 24 or a[-1] == STOP)


_PROMPT_WIDTH, _ANSWER_WIDTH = 16, 24  # the hand drafting's padded widths: one program


@functools.partial(nnx.jit, static_argnames=("stages",))
def _draft_by_hand(target, drafter, seq, p, t, *, stages):
  """Drafts `stages` stages at answer position t, the drafter fed as the engine feeds it: the
  prefill's taps for the prompt (seq[:p]), then a forward continuing the target's cache for
  the answer's first t positions (a verification's)."""
  one = jnp.ones((1,), jnp.int32)
  cache = target.init_cache(batch_size=1, capacity=64)
  pre = target(seq[:, :_PROMPT_WIDTH], positions=jnp.arange(_PROMPT_WIDTH)[None], cache=cache,
               taps=drafter.taps)
  state = drafter.init_state(batch_size=1, capacity=64)
  state = drafter.commit(state, tokens=seq[:, :_PROMPT_WIDTH], features=pre.taps,
                         next_tokens=seq[:, 1:_PROMPT_WIDTH + 1], starts=0 * one, counts=p * one)
  tokens = jax.lax.dynamic_slice_in_dim(seq, p, _ANSWER_WIDTH, axis=1)
  following = jax.lax.dynamic_slice_in_dim(seq, p + 1, _ANSWER_WIDTH, axis=1)
  more = target(tokens, positions=p + jnp.arange(_ANSWER_WIDTH)[None],
                cache=pre.cache.with_lengths(p * one), taps=drafter.taps)
  state = drafter.commit(state, tokens=tokens, features=more.taps, next_tokens=following,
                         starts=p * one, counts=t * one)
  out = []
  for _ in range(stages):
    state, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=GAMMA,
                                       sampling=GREEDY)
    learned = (jnp.sum(jnp.log(stage.confidence[0])) if stage.confidence is not None
               else jnp.zeros(()))
    out.append((stage.tokens[0], jnp.sum(stage.logprobs[0]), learned))
  return out


def _direct(target, drafter, prompt, answer, t, *, stages=3):
  """Per stage (leading drafts equal to the answer or -1, probability score, learned
  score) of drafting at answer position t by hand (`_draft_by_hand`)."""
  assert len(prompt) <= _PROMPT_WIDTH and t <= len(answer) <= _ANSWER_WIDTH
  seq = np.zeros((1, 2 * _PROMPT_WIDTH + 2 * _ANSWER_WIDTH), np.int32)
  seq[0, :len(prompt) + len(answer)] = prompt + answer
  n = len(prompt) + t
  out = []
  for s, (tokens, probability, learned) in enumerate(_draft_by_hand(
      target, drafter, jnp.asarray(seq), len(prompt), t, stages=stages)):
    first = n + 1 + s * GAMMA
    truth = seq[0, first:min(first + GAMMA, len(prompt) + len(answer))]
    tokens = np.asarray(tokens)
    lead = 0
    while lead < len(truth) and tokens[lead] == truth[lead]:
      lead += 1
    out.append((lead if len(truth) == GAMMA else -1, float(probability), float(learned)))
  return out


def test_oracle_accepts_every_valid_stage(setup):
  """A drafter that drafts with the target: every stage inside the answer is fully
  accepted, and the table's counts are the valid positions."""
  target, prompts, answers = setup
  drafter = drafter_fixtures.oracle(target, block_size=GAMMA)
  tables = measuring.measure(target, drafter, prompts, answer_tokens=answers, max_new_tokens=24,
                             batch_size=4)
  assert set(tables) == {"probability"}
  t = tables["probability"]
  valid = [max(0, len(a) - GAMMA * s) for a in answers for s in (1, 2, 3)]
  assert t.count[0].sum() == sum(max(0, len(a) - GAMMA) for a in answers)
  assert t.count[1].sum() == sum(valid) - t.count[0].sum()
  assert t.next_count[0].sum() == sum(max(0, len(a) - 2 * GAMMA) for a in answers)
  np.testing.assert_allclose(t.full[t.count > 0], 1.0)
  np.testing.assert_allclose(t.accepted[t.count > 0], GAMMA)
  assert "12 prompts" not in t.source and "6 prompts" in t.source


def test_samples_match_direct_drafting(setup):
  """Accepted counts and scores at answer positions equal drafting there by hand."""
  target, prompts, answers = setup
  drafter = drafter_fixtures.perturbed(target, noise_scale=1.0, block_size=GAMMA)
  s = measuring.stage_samples(target, drafter, prompts, answers, block_size=GAMMA, batch_size=4)
  assert s.learned is None
  assert len(s.row) == sum(max(0, len(a) - GAMMA) for a in answers)
  hits = s.accepted[:, 0]
  assert 0.05 < np.mean(hits > 0) < 0.95  # partial acceptance: the check below can fail
  checked = 0
  for row, t in [(0, 0), (0, 7), (3, 5), (5, 2)]:
    sel = np.flatnonzero((s.row == row) & (s.position == t))
    assert len(sel) == 1
    want = _direct(target, drafter, prompts[row], answers[row], t)
    assert [int(a) for a in s.accepted[sel[0]]] == [w[0] for w in want]
    np.testing.assert_allclose(s.probability[sel[0]], [w[1] for w in want], atol=1e-4)
    checked += sum(w[0] > 0 for w in want)
  assert checked > 0
  # Drafting at every second position, committing two at a time: the same stages there.
  strided = measuring.stage_samples(target, drafter, prompts, answers, block_size=GAMMA,
                                    batch_size=4, stride=2)
  assert set(strided.position % 2) == {0}
  index = {(r, t): i for i, (r, t) in enumerate(zip(s.row, s.position))}
  same = [index[r, t] for r, t in zip(strided.row, strided.position)]
  np.testing.assert_array_equal(strided.accepted, s.accepted[same])


def test_learned_score_of_a_confidence_head(setup):
  """A drafter with a confidence head gets a second table, scored by sum log c_k; both
  scores are those of drafting by hand with the target's features."""
  target, prompts, answers = setup
  drafter = build_drafter({"kind": "dspark", "block_size": GAMMA, "markov_rank": 8},
                          target=target, rngs=nnx.Rngs(0))
  assert drafter.has_confidence
  rows = [1, 2]
  tables = measuring.measure(target, drafter, [prompts[r] for r in rows],
                             answer_tokens=[answers[r] for r in rows], max_new_tokens=24,
                             batch_size=2)
  assert set(tables) == {"probability", "learned"}
  assert tables["learned"].count[0].sum() == tables["probability"].count[0].sum()
  s = measuring.stage_samples(target, drafter, [prompts[r] for r in rows],
                              [answers[r] for r in rows], batch_size=2)
  for i, t in [(0, 0), (1, 4)]:
    sel = np.flatnonzero((s.row == i) & (s.position == t))[0]
    want = _direct(target, drafter, prompts[rows[i]], answers[rows[i]], t)
    assert [int(a) for a in s.accepted[sel]] == [w[0] for w in want]
    np.testing.assert_allclose(s.probability[sel], [w[1] for w in want], atol=1e-3)
    np.testing.assert_allclose(s.learned[sel], [w[2] for w in want], atol=1e-3)


# ------------------------------------------------------------------ exports
def test_export_load_attaches_the_table(tiny, tmp_path):
  drafter = build_drafter({"kind": "block", "block_size": GAMMA}, target=tiny, rngs=nnx.Rngs(0))
  table = _table()
  path = drafter_io.export_drafter(drafter, tmp_path / "with", target_name="tiny",
                                   calibration={"probability": table})
  loaded = drafter_io.load_drafter(path, target=tiny)
  got = calibration.of(loaded)
  assert set(got) == {"probability/gamma3"}
  np.testing.assert_allclose(got["probability/gamma3"].full, table.full, atol=1e-6)
  assert calibration.resolve(None, drafter=loaded, score="probability", block_size=3) is not None

  # Written into an export without one: the rest of drafter.json is kept.
  plain = drafter_io.export_drafter(drafter, tmp_path / "plain", target_name="tiny")
  assert calibration.of(drafter_io.load_drafter(plain, target=tiny)) == {}
  info_path = os.path.join(plain, drafter_io.INFO_FILE)
  before = json.load(open(info_path))
  assert drafter_io.write_calibration(plain, {"probability": table}) == info_path
  after = json.load(open(info_path))
  assert {k: v for k, v in after.items() if k != "calibration"} == before
  # Another gamma is added, the same score and gamma replaced.
  two = calibration.from_samples(scores=[[-1.0]], accepted=[[1]], block_size=2,
                                 score="probability", source="gamma 2")
  drafter_io.write_calibration(plain, [two, dataclasses.replace(table, source="again")])
  got = calibration.of(drafter_io.load_drafter(plain, target=tiny))
  assert {k: t.source for k, t in got.items()} == {"probability/gamma3": "again",
                                                   "probability/gamma2": "gamma 2"}

  after = json.load(open(info_path))
  after["calibration"]["probability/gamma3"]["full"] = [[0.5]]
  with open(info_path, "w") as f:
    json.dump(after, f)
  with pytest.raises(ConfigError, match=f"{info_path}.*calibration"):
    drafter_io.load_drafter(plain, target=tiny)
