"""The drafting back-off: pauses double after fruitless rounds, reset on success."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dloop_jax.decoding import draft_policy


def _run(accepted_when_drafting, *, max_skip, rounds):
  """Drafting pattern of one row whose drafting rounds accept the given counts in turn."""
  state = draft_policy.Backoff.create(1)
  outcomes = iter(accepted_when_drafting)
  pattern = []
  for _ in range(rounds):
    drafted = draft_policy.wants_draft(state, active=jnp.asarray([True]))
    accepted = jnp.asarray([next(outcomes) if bool(drafted[0]) else 0], jnp.int32)
    pattern.append("D" if bool(drafted[0]) else ".")
    state = draft_policy.update(state, drafted=drafted, accepted=accepted, max_skip=max_skip)
  return "".join(pattern)


def test_pauses_double_and_reset_after_an_accepted_draft():
  assert _run([0, 0, 0, 2, 1, 0, 0], max_skip=8, rounds=16) == "D.D..D....DDD.D."


def test_pause_is_capped_by_max_skip_and_zero_disables_it():
  assert _run([0] * 20, max_skip=2, rounds=12) == "D.D..D..D..D"
  assert _run([0] * 20, max_skip=0, rounds=6) == "DDDDDD"


def test_rows_are_independent_and_inactive_rows_never_draft():
  state = draft_policy.Backoff.create(3)
  active = jnp.asarray([True, True, False])
  drafted = draft_policy.wants_draft(state, active=active)
  np.testing.assert_array_equal(drafted, [True, True, False])
  state = draft_policy.update(state, drafted=drafted, accepted=jnp.asarray([0, 3, 0]),
                              max_skip=8)
  np.testing.assert_array_equal(draft_policy.wants_draft(state, active=active),
                                [False, True, False])
  np.testing.assert_array_equal(state.pause, [1, 0, 0])


def test_generate_pauses_a_drafter_that_is_never_right_and_stays_lossless(tiny):
  import drafter_fixtures  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
  from lossless import assert_same_or_near_tie  # pylint: disable=g-import-not-at-top

  prompts = [[3, 9, 4], [7, 1, 5, 2, 8], [11]]
  ar = generate(tiny, prompts, max_new_tokens=24)
  for kind, drafter, backoff in [
      ("random", drafter_fixtures.random_drafter(tiny, seed=4), 8),
      ("oracle", drafter_fixtures.oracle(tiny), 8),
      ("random", drafter_fixtures.random_drafter(tiny, seed=4), 0)]:
    out = generate(tiny, prompts, max_new_tokens=24, mode="dloop", drafter=drafter,
                   block_size=2, max_stages=2, gate=-1.0, schedule="off",
                   draft_backoff=backoff, lookup="off")  # the drafter's own drafts
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny, p, want, got)
    for row in out.rows:
      rounds_without_drafts = row.stage_histogram[0]
      if backoff and row.accepted == 0:
        # Pauses of 1, 2, 4, 8, 8, ... rounds between fruitless drafting rounds.
        assert rounds_without_drafts >= row.rounds // 2, row
      elif backoff == 0:
        assert rounds_without_drafts == 0
    if kind == "oracle":
      assert all(r.stage_histogram[0] == 0 for r in out.rows)
