"""The drafter reads a drafting pause's tokens in one forward, when drafting resumes.

During a pause of the drafting back-off (`draft_policy`) every round is a plain
decode step, and the drafter has nothing to do but keep up: read each committed
token with the target's taps there (`Drafter.commit`). Reading them one by one
costs a drafter forward per step, a few percent of a step on a CPU, on every
step of every pause. Nothing needs the drafter's state until it drafts again,
so the steps of a pause only remember what the drafter would have read, and the
round that drafts next commits all of it first, in one forward of a static
width K (the drafter's state then equals the one of step-by-step commits, up to
floating-point rounding of a wider product: drafts may differ in rare near-ties
of the drafter, which cannot change what is committed):

    round:        paused   paused   paused   drafting round
    target reads  x_n      x_n+1    x_n+2    x_n+3, drafts ...
    remembered    (x_n, f_n, x_n+1) (x_n+1, f_n+1, x_n+2) (x_n+2, f_n+2, x_n+3)
    drafter                                  commit of the 3 remembered pairs,
                                             then drafting from x_n+3

A drafting round whose rows commit one token each (every draft rejected or
not verified: the target's own token only) leaves its commit to the next
drafting round in the same way; the drafter's unverified drafts of that round
are discarded by that commit. Only a round in which some row accepted a draft
commits at once.

A pause longer than K steps is cut into pieces of K: the pause loop stops when
a row's memory is full, and the next round commits it (drafting only for the
rows whose pause is over).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding.drafter import Drafter
from dloop_jax.models import kv_cache as kv_lib


# Tokens remembered before the memory is committed (K, static): a pause of 8
# rounds plus the token of the drafting round before it. Longer pauses (the
# default back-off reaches 64 rounds, `config.DEFAULT_DRAFT_BACKOFF`) are cut
# into pieces of K; a wider K would make every catch-up forward wider, also the
# frequent ones after a single fruitless drafting round.
CAPACITY = 9


@struct.dataclass
class Deferred:
  """What the drafter has not read yet, per row.

  Attributes:
    tokens: [B, K] tokens the target read (`Drafter.commit`'s `tokens`).
    features: [B, K, n_taps, D] the target's taps there.
    next_tokens: [B, K] the token committed after each.
    count: [B] int32 pairs held (the first `count` slots are valid).
  """

  tokens: jax.Array
  features: jax.Array
  next_tokens: jax.Array
  count: jax.Array

  @classmethod
  def create(cls, *, batch_size: int, num_taps: int, hidden_size: int, dtype,
             capacity: int = CAPACITY) -> "Deferred":
    tokens = jnp.zeros((batch_size, capacity), jnp.int32)
    return cls(tokens=tokens,
               features=jnp.zeros((batch_size, capacity, num_taps, hidden_size), dtype),
               next_tokens=tokens, count=jnp.zeros((batch_size,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.tokens.shape[1]


def push(state: Deferred, *, token: jax.Array, features: jax.Array, next_token: jax.Array,
         committed: jax.Array) -> Deferred:
  """Remembers one step: token [B], features [B, 1, n_taps, D], next_token [B] where `committed`."""
  at = jnp.minimum(state.count, state.capacity - 1)
  return state.replace(
      tokens=kv_lib.write_rows(state.tokens, token[:, None], at),
      features=kv_lib.write_rows(state.features, features, at),
      next_tokens=kv_lib.write_rows(state.next_tokens, next_token[:, None], at),
      count=state.count + committed.astype(jnp.int32))


def full(state: Deferred) -> jax.Array:
  """[B] bool: rows whose memory has no free slot."""
  return state.count >= state.capacity


def flush(state: Deferred, *, drafter: Drafter, drafter_state: Any,
          committed_length: jax.Array) -> tuple[Any, Deferred, jax.Array]:
  """Commits what the drafter has not read, in one forward (skipped when nothing is held).

  Args:
    committed_length: [B] the target cache's length: the remembered pairs are
      its last `count` positions.

  Returns:
    The drafter state, the emptied memory, and [B] bool: rows that had pairs
    (each of them ran one drafter forward).
  """
  held = state.count > 0

  def commit(drafter_state):
    # A row holding nothing commits no pair at its current length: unchanged.
    return drafter.commit(drafter_state, tokens=state.tokens, features=state.features,
                          next_tokens=state.next_tokens,
                          starts=committed_length - state.count, counts=state.count)

  drafter_state = jax.lax.cond(jnp.any(held), commit, lambda s: s, drafter_state)
  return drafter_state, state.replace(count=jnp.zeros_like(state.count)), held
