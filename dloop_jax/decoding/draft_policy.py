"""Whether to draft at all this round: back off after drafting that bought nothing.

The gate decides how many stages a round drafts, the scheduler how many drafts
it verifies; both act after drafting has been paid for. Where the drafter is
weak (a passage it cannot predict), the scheduler verifies nothing and the
drafting was wasted; on a CPU a drafting stage plus its bookkeeping cost a
sizeable fraction of a target step. So a row whose last drafting round
committed no draft skips drafting for a while (plain decode steps; the drafter
reads the pause's tokens when drafting resumes, `deferred`), and the pause doubles with each
consecutive fruitless round, up to `max_skip` rounds; the first round whose
drafts are accepted resets it:

    round:     1   2   3   4   5   6   7   8   9  10  11  12
    drafts?    D   .   D   .   .   D   .   .   .   .   D   D
    accepted   0       0           0                   2   ...   (pause reset)

Lossless: the decision depends only on earlier rounds (never on the drafts it
would verify), and a plain step commits exactly the target's token; greedy
output and the sampling distribution are unchanged.

Batch > 1: the drafter runs for the whole batch, so a round drafts when any
active row is ready; rows that are pausing skip verification of those drafts
(they draft nothing) and keep counting down.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Backoff:
  """Per-row pause state.

  Attributes:
    wait: [B] int32 rounds left before the row drafts again (0 = drafts now).
    pause: [B] int32 length of the row's last pause (0 after a fruitful round).
  """

  wait: jax.Array
  pause: jax.Array

  @classmethod
  def create(cls, batch_size: int) -> "Backoff":
    zeros = jnp.zeros((batch_size,), jnp.int32)
    return cls(wait=zeros, pause=zeros)


def wants_draft(state: Backoff, *, active: jax.Array) -> jax.Array:
  """[B] bool: the rows that draft this round."""
  return active & (state.wait <= 0)


def update(state: Backoff, *, drafted: jax.Array, accepted: jax.Array,
           max_skip: jax.Array | int) -> Backoff:
  """The pause state after a round.

  Args:
    state: before the round.
    drafted: [B] bool, the row drafted this round.
    accepted: [B] int32 drafts of the row accepted this round.
    max_skip: longest pause in rounds (a traced scalar; 0 disables pausing).

  Returns:
    The new `Backoff`.
  """
  fruitless = drafted & (accepted <= 0)
  pause = jnp.where(fruitless, jnp.minimum(jnp.maximum(2 * state.pause, 1), max_skip),
                    jnp.where(drafted, 0, state.pause)).astype(jnp.int32)
  wait = jnp.where(drafted, jnp.where(fruitless, pause, 0),
                   jnp.maximum(state.wait - 1, 0)).astype(jnp.int32)
  return Backoff(wait=wait, pause=pause)
