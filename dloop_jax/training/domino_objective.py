"""Domino's objective on one stage of teacher-forced drafts.

    loss = (1 - lambda) * CE(corrected logits) + lambda * CE(base logits)

both with position weights exp(-(k - 1) / gamma), the GRU reading the
ground-truth tokens of the block (anchor first). The base-anchored curriculum:
lambda falls linearly from 1 to 0 over the first `curriculum_fraction` of
training (0.5: the first half), then stays 0, so the backbone first learns to
draft alone and the head then learns to correct it. `progress` (the fraction
of training done, from the trainer) drives it; without it, or with
`curriculum_fraction` 0 (the loop-aware fine-tune's default: it starts from a
trained drafter), lambda is 0.

`dloop_jax.training.objectives` picks the anchors and labels and calls
`stage_loss` (for the `domino` objective and for each loop-aware stage).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dloop_jax.drafters.domino import DominoDrafter
from dloop_jax.training import metrics as metrics_lib


def base_weight(progress: jax.Array | float | None, curriculum_fraction: float) -> jax.Array:
  """lambda: 1 at the start, 0 from `curriculum_fraction` of training on."""
  if progress is None or curriculum_fraction <= 0:
    return jnp.zeros((), jnp.float32)
  p = jnp.asarray(progress, jnp.float32)
  return jnp.clip(1.0 - p / curriculum_fraction, 0.0, 1.0)


def stage_loss(drafter: DominoDrafter, hidden: jax.Array, *, labels: jax.Array,
               prev: jax.Array, valid: jax.Array, weights: jax.Array,
               lam: jax.Array, per_prediction=None
               ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """The Domino loss of one stage.

  Args:
    drafter: the Domino drafter.
    hidden: [B, A, gamma, D] backbone outputs.
    labels: [B, A, gamma] target ids to predict.
    prev: [B, A, gamma] the block's ground-truth tokens x_0 (anchor) ..
      x_{gamma-1}: the token before each label, the GRU's inputs.
    valid: [B, A, gamma] bool, predictions that count.
    weights: [B, A, gamma] position weights.
    lam: scalar base weight lambda.
    per_prediction: `(logits, nll) -> loss` per prediction (the distillation
      terms, `objectives.soft_loss`), applied to both logits; None = nll.

  Returns:
    (loss, correct [B, A, gamma] bool from the corrected logits, {metric: scalar}).
  """
  w = valid.astype(jnp.float32) * weights

  @jax.checkpoint
  def terms(h):
    base, corrected = drafter.corrected_logits(h, prev)
    def nll(logits):
      out = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None],
                                 axis=-1)[..., 0]
      return out if per_prediction is None else per_prediction(logits, out)

    return nll(base), nll(corrected), jnp.argmax(corrected, axis=-1)

  nll_base, nll_corr, pred = terms(hidden)
  mean = lambda x: metrics_lib.safe_ratio(jnp.sum(x * w), jnp.sum(w))
  ce_base, ce_corr = mean(nll_base), mean(nll_corr)
  loss = (1.0 - lam) * ce_corr + lam * ce_base
  return loss, (pred == labels) & valid, {"loss_base": ce_base, "loss_corrected": ce_corr,
                                          "base_weight": lam}
