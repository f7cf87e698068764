"""DSpark's objective on one stage of teacher-forced drafts.

    loss = ce_weight * CE + l1_weight * ||p_draft - p_target||_1
           + confidence_weight * BCE(c_k, 1 - 1/2 ||p_draft - p_target||_1)

each term a mean over the stage's valid drafts with position weights
exp(-(k - 1) / gamma) (DeepSpec: 0.1, 0.9, 1.0). p_draft is the drafter's full
distribution (backbone + Markov bias from the ground-truth previous token);
p_target is the target's distribution at that position when the batch has
`target_logits`; its k likeliest tokens renormalized when the batch has
`target_topk_*` (what `target_topk` datasets store: with p_target zero off
those k tokens, ||p_draft - p_target||_1 = sum_k |p_draft - p_target| +
(1 - sum_k p_draft), exact for that distribution); else the one-hot of the
label: the target's distribution at temperature 0 when the data are its
greedy responses. The BCE target is the
probability that draft k is accepted by the sampling rule; it is a constant
(no gradient through it), while the head's own input may shape the backbone.

`dloop_jax.training.objectives` picks the anchors and labels and calls
`stage_loss` (for the `dspark` objective and for each loop-aware stage).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from dloop_jax.drafters.dspark import DSparkDrafter
from dloop_jax.training import metrics as metrics_lib

DEFAULTS = dict(ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)


def topk_total_variation(logp: jax.Array, ids: jax.Array, probs: jax.Array) -> jax.Array:
  """1/2 ||p_draft - p_target||_1 with p_target on k tokens: [..., V], [..., k] -> [...].

  p_target = probs / sum(probs) on `ids`, 0 elsewhere; rows whose probs are all
  0 (padding) give 1/2 (1 - 0) sums that the caller's mask removes.
  """
  p_draft = jnp.exp(jnp.take_along_axis(logp, ids, axis=-1))
  total = jnp.sum(probs, axis=-1, keepdims=True)
  p_target = probs / jnp.where(total > 0, total, 1.0)
  inside = jnp.sum(jnp.abs(p_draft - p_target), axis=-1)
  outside = jnp.clip(1.0 - jnp.sum(p_draft, axis=-1), 0.0, 1.0)
  return 0.5 * (inside + outside)


def stage_loss(drafter: DSparkDrafter, hidden: jax.Array, *, labels: jax.Array,
               prev: jax.Array, valid: jax.Array, weights: jax.Array,
               target_probs: jax.Array | None, cfg: dict[str, Any],
               target_topk: tuple[jax.Array, jax.Array] | None = None,
               ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """The DSpark loss of one stage.

  Args:
    drafter: the DSpark drafter.
    hidden: [B, A, gamma, D] backbone outputs.
    labels: [B, A, gamma] target ids to predict.
    prev: [B, A, gamma] the ground-truth token before each label (the Markov
      head's and the confidence head's input).
    valid: [B, A, gamma] bool, predictions that count.
    weights: [B, A, gamma] position weights.
    target_probs: [B, A, gamma, V] the target's distributions, or None.
    cfg: ce_weight, l1_weight, confidence_weight.
    target_topk: (ids [B, A, gamma, k] int32, probs [B, A, gamma, k]) the
      target's k likeliest tokens, used when `target_probs` is None; with
      neither, the one-hot of the label.

  Returns:
    (loss, correct [B, A, gamma] bool, {metric: scalar}).
  """
  w = valid.astype(jnp.float32) * weights
  with_conf = drafter.confidence_proj is not None

  # Logits recomputed in the backward pass instead of stored (as `_ce_terms`).
  @jax.checkpoint
  def terms(h):
    logits = drafter.head_logits(h, prev)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if target_probs is None and target_topk is not None:
      tv = topk_total_variation(logp, *target_topk)
    else:
      p_t = (jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
             if target_probs is None else target_probs)
      tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - p_t), axis=-1)
    if with_conf:
      conf_logit = drafter.confidence_logit(h, prev)
      bce = optax.sigmoid_binary_cross_entropy(conf_logit, jax.lax.stop_gradient(1.0 - tv))
      conf = jax.nn.sigmoid(conf_logit)
    else:
      bce = conf = jnp.zeros_like(nll)
    return nll, tv, bce, conf, jnp.argmax(logits, axis=-1)

  nll, tv, bce, conf, pred = terms(hidden)
  mean = lambda x: metrics_lib.safe_ratio(jnp.sum(x * w), jnp.sum(w))
  ce, l1, conf_loss = mean(nll), mean(2.0 * tv), mean(bce)
  loss = cfg["ce_weight"] * ce + cfg["l1_weight"] * l1
  metrics = {"loss_ce": ce, "loss_l1": l1}
  if with_conf:
    loss = loss + cfg["confidence_weight"] * conf_loss
    metrics.update(loss_confidence=conf_loss, confidence_mean=mean(conf),
                   acceptance_prob_mean=mean(1.0 - tv))
  return loss, (pred == labels) & valid, metrics
