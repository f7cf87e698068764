"""DLoop's confidence gate: draft another stage instead of verifying?"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stage_confidence(logprobs: jax.Array) -> jax.Array:
  """conf_s: sum of the drafter's log-probabilities of one stage's drafts.

  The score is per stage: it resets every stage, so a confident stage cannot
  buy credit for an uncertain one.

  Args:
    logprobs: [B, gamma] log-probabilities of the tokens drafted in this stage.

  Returns:
    [B] f32 scores.
  """
  return jnp.sum(logprobs.astype(jnp.float32), axis=-1)


def continue_drafting(confidence: jax.Array, *, gate: jax.Array | float,
                      stages_done: jax.Array | int, max_stages: int) -> jax.Array:
  """Whether each row drafts stage `stages_done + 1` before verifying.

  Another stage while `conf_s >= gate` and fewer than `max_stages` stages were
  drafted. With gate = -inf every row drafts `max_stages` stages; with
  gate = +inf exactly one (standard speculative decoding).

  Args:
    confidence: [B] score of the stage just drafted.
    gate: threshold g (the paper uses -0.5 or -0.75).
    stages_done: stages drafted so far, including the one just scored.
    max_stages: S_max.

  Returns:
    [B] bool.
  """
  return (confidence >= gate) & (jnp.asarray(stages_done) < max_stages)
