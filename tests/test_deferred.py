"""A drafting pause's tokens, read by the drafter in one forward when drafting resumes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import generate
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters.registry import resolve_config
from dloop_jax.drafters.block import BlockDrafter
from dloop_jax.drafters.eagle3 import Eagle3Drafter


def _drafter(tiny, kind):
  cls = Eagle3Drafter if kind == "eagle3" else BlockDrafter
  return cls(resolve_config({"kind": kind, "block_size": 3}, tiny.config), target=tiny,
             rngs=nnx.Rngs(5))


# The drafter's calls as programs (one per shape), not op by op.
@nnx.jit
def _commit(drafter, state, tokens, features, next_tokens, starts, counts):
  return drafter.commit(state, tokens=tokens, features=features, next_tokens=next_tokens,
                        starts=starts, counts=counts)


@nnx.jit
def _flush(drafter, deferred, state, committed_length):
  return deferred_lib.flush(deferred, drafter=drafter, drafter_state=state,
                            committed_length=committed_length)


@nnx.jit(static_argnums=3)
def _greedy_stage(drafter, state, key, block_size):
  return drafter.draft_stage(state, key=key, block_size=block_size,
                             sampling=sampling_lib.GREEDY)[1]


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_one_deferred_commit_equals_step_by_step_commits(tiny, kind):
  """Rows hold 3, 0 and 5 steps of a pause; the drafter drafts the same after either."""
  drafter = _drafter(tiny, kind)
  rng = np.random.default_rng(0)
  b, n_taps, d, prompt = 3, len(drafter.taps), tiny.config.hidden_size, 6
  steps = np.asarray([3, 0, 5])
  total = prompt + int(steps.max())
  tokens = jnp.asarray(rng.integers(0, 64, (b, total + 1)), jnp.int32)
  features = jnp.asarray(rng.normal(size=(b, total, n_taps, d)), jnp.float32)
  state = drafter.init_state(batch_size=b, capacity=32)
  state = _commit(drafter, state, tokens[:, :prompt], features[:, :prompt],
                  tokens[:, 1:prompt + 1], jnp.zeros((b,), jnp.int32),
                  jnp.full((b,), prompt, jnp.int32))
  push = jax.jit(deferred_lib.push)

  eager, deferred = state, deferred_lib.Deferred.create(
      batch_size=b, num_taps=n_taps, hidden_size=d, dtype=jnp.float32)
  for t in range(prompt, total):
    committed = jnp.asarray(t - prompt < steps)
    length = jnp.asarray(prompt + np.minimum(t - prompt, steps), jnp.int32)
    eager = _commit(drafter, eager, tokens[:, t:t + 1], features[:, t:t + 1],
                    tokens[:, t + 1:t + 2], length, committed.astype(jnp.int32))
    deferred = push(deferred, token=tokens[:, t], features=features[:, t:t + 1],
                    next_token=tokens[:, t + 1], committed=committed)
  np.testing.assert_array_equal(deferred.count, steps)
  assert not np.any(deferred_lib.full(deferred))
  lazy, emptied, held = _flush(drafter, deferred, state,
                               jnp.asarray(prompt + steps, jnp.int32))
  np.testing.assert_array_equal(held, steps > 0)
  np.testing.assert_array_equal(emptied.count, 0)

  key = jax.random.key(1)
  want = _greedy_stage(drafter, eager, key, 3)
  got = _greedy_stage(drafter, lazy, key, 3)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_memory_is_full_at_capacity(tiny):
  deferred = deferred_lib.Deferred.create(batch_size=2, num_taps=1, hidden_size=4,
                                          dtype=jnp.float32, capacity=2)
  for committed in ([True, True], [True, False]):
    deferred = deferred_lib.push(deferred, token=jnp.zeros((2,), jnp.int32),
                                 features=jnp.ones((2, 1, 1, 4)),
                                 next_token=jnp.ones((2,), jnp.int32),
                                 committed=jnp.asarray(committed))
  np.testing.assert_array_equal(deferred_lib.full(deferred), [True, False])


def test_pauses_longer_than_the_memory_stay_lossless(tiny):
  """Pauses of up to 32 rounds are cut at the memory's capacity (9 tokens)."""
  import drafter_fixtures  # pylint: disable=g-import-not-at-top
  from lossless import assert_same_or_near_tie  # pylint: disable=g-import-not-at-top

  prompts = [[3, 9, 4], [7, 1, 5, 2, 8]]
  ar = generate(tiny, prompts, max_new_tokens=60)
  out = generate(tiny, prompts, max_new_tokens=60, mode="dloop",
                 drafter=drafter_fixtures.random_drafter(tiny, seed=4), block_size=2,
                 max_stages=2, gate=-1.0, draft_backoff=32, lookup="off")
  for p, want, got in zip(prompts, ar.tokens, out.tokens):
    assert_same_or_near_tie(tiny, p, want, got)
  for row in out.rows:
    assert row.new_tokens == 60
    # Drafting rounds after pauses of 1, 2, 4, 8, 16: at most 7 in 60 tokens.
    assert sum(row.stage_histogram[1:]) <= 7, row
