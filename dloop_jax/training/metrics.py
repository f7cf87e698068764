"""Training metrics of drafters: per-position accuracy and expected acceptance length."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def safe_ratio(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den, 0 where den is 0."""
  return jnp.where(den > 0, num / jnp.maximum(den, 1), 0.0).astype(jnp.float32)


def expected_acceptance_length(accuracies: jax.Array) -> jax.Array:
  """tau ~= 1 + sum_k prod_{j <= k} acc_j for one verification of K drafts.

  acc_j is the drafter's top-1 accuracy at draft position j. The drafts of a
  block are accepted up to the first miss, and the target adds one token, so
  with acc_j read as P(draft j correct | drafts < j correct), tau is exactly
  this sum. The approximation: training measures acc_j with ground-truth
  tokens before position j (teacher forcing), over all examples rather than
  over those whose earlier drafts were right. Misses that cluster on hard
  examples make the true tau larger; a drafter that benefits from its own
  earlier drafts being wrong never happens in practice. Greedy acceptance is
  assumed (sampling acceptance min(1, p/q) is not top-1 accuracy).

  Args:
    accuracies: [K] acc_1 .. acc_K.

  Returns:
    [] f32.
  """
  return 1.0 + jnp.sum(jnp.cumprod(accuracies.astype(jnp.float32)))


def position_metrics(correct: jax.Array, counted: jax.Array, *, prefix: str = "") -> dict[str, jax.Array]:
  """`{prefix}acc_1..acc_K` and `{prefix}expected_acceptance_length`.

  Args:
    correct: [K] correct top-1 predictions at each draft position.
    counted: [K] predictions evaluated at each position.
    prefix: metric name prefix.
  """
  acc = safe_ratio(correct, counted)
  out = {f"{prefix}acc_{k + 1}": acc[k] for k in range(acc.shape[0])}
  out[f"{prefix}expected_acceptance_length"] = expected_acceptance_length(acc)
  return out
