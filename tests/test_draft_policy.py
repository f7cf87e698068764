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
