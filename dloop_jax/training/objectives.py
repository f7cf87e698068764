"""Drafter training objectives: EAGLE-3 training-time test, block, DSpark, Domino, loop-aware.

    loss, metrics = loss_fn(drafter, batch, key, objective="eagle3_ttt", cfg={...})

All are pure functions of arrays with static shapes (the trainer jits them with
shardings); random choices (anchors, the number of loop stages) are traced,
and a traced number of stages picks one of a few static unrolls with
`lax.switch`.

Batch (dict of arrays; B rows of T):

    tokens       [B, T] int32    prompt + response, 0 at padding
    loss_mask    [B, T] int32    1 where tokens[t] is a response token to predict
    features     [B, T, n_taps, D] target taps after reading tokens[t]
    segment_ids  [B, T] int32    packed example id, 0 = padding
    positions    [B, T] int32    position within its own example
    target_logits [B, T, V]      optional (dspark): the target's logits after
                                 reading tokens[t]; without them the target's
                                 distribution is the one-hot of the next token
    target_topk_ids   [B, T, k]  optional (dspark), what datasets built with
    target_topk_probs [B, T, k]  `target_topk` hold: the target's k likeliest
                                 next tokens and their probabilities (its
                                 distribution renormalized over them)
    target_hidden [B, T, D]      optional: the target's last decoder layer's
                                 output after reading tokens[t] (online)

A prediction of tokens[p] counts when loss_mask[p] is 1 and p lies in the same
segment as every position it is conditioned on; attention never crosses
segments, so nothing in another segment or past the loss region changes the
loss.

Objectives and their `cfg` keys (any Mapping or ConfigDict):

  eagle3_ttt   ttt_steps (7), step_decay (0.8).
    Unroll k steps feeding back the drafter's own hidden state; step i
    (0-based) predicts the token i + 1 drafts ahead and weighs 0.8^i.
  block        block_size (drafter's), anchors_per_sequence (16).
    Random anchors inside the response, a block of gamma masks after each;
    the k-th draft of a block weighs exp(-(k - 1) / gamma).
  dspark       block_size, anchors_per_sequence (as block), ce_weight (0.1),
               l1_weight (0.9), confidence_weight (1.0).
    The block objective's anchors and position weights on DSpark's shifted
    block: CE + L1 to the target distribution + confidence BCE
    (`dspark_objective`).
  domino       block_size, anchors_per_sequence (as block), curriculum_fraction
               (0.5; loop-aware: 0).
    (1 - lambda) CE(corrected) + lambda CE(base), lambda from 1 to 0 over the
    first curriculum_fraction of training (`domino_objective`; needs the
    training progress, which the trainer passes).
  loop_aware   loop_stages (alias max_stages; 3), fixed_stages (0 = random),
               block_size (drafter's), base_objective (optional check), and
               the base objective's keys (step_decay / anchors_per_sequence).
    docs/design.md §Loop-aware training: S ~ U{1..N} drafting stages of gamma tokens; inputs
    are ground-truth tokens, the conditioning at earlier stages' positions is
    the drafter's own hidden states; loss = (L^(1) + L^(S)) / 2, the base
    objective's loss restricted to the first and to the last stage. For
    EAGLE-3 a stage is gamma steps of the training-time-test chain (`ttt_steps`
    is not used: stages set the unroll); for the block drafter stage s + 1 is
    anchored at the ground-truth token ending stage s and sees stage s's
    stand-in context (`BlockDrafter.train_stages`); DSpark and Domino stages
    are the block drafter's, each with its own objective.

Distillation (every objective but dspark, whose own terms already read the
target's distribution): hard_weight (1), kl_weight (0), tv_weight (0) weigh
per prediction the CE on the data's token, KL(p_target || p_draft) and the
total variation 1/2 ||p_target - p_draft||_1, p_target read from
`target_logits` (online) or `target_topk_*` (datasets built with target_topk;
renormalized over the draft vocabulary when it is reduced). EAGLE-3 also
takes feature_regression_weight (0): smooth-L1 from each TTT step's hidden
state to the target's last-layer output after the token it continues
(`target_hidden`, which online training computes). The defaults are hard CE,
bit for bit.

Every objective also takes feature_noise (0: none): Gaussian noise on the
target's taps, each tap vector's of RMS `feature_noise` times its own RMS
(scale-free across layers, whose hidden states differ in size by orders of
magnitude). At inference a drafter reads taps of contexts it never trained
on; noise in training keeps a small drafter from keying on the exact taps of
its training answers (EAGLE trains on noised hidden states for the same
reason).

Metrics: loss, acc_1 .. acc_K (top-1 accuracy at draft position k; K = ttt
steps, or gamma for block / loop-aware), expected_acceptance_length (see
`metrics.expected_acceptance_length`), and for loop-aware loss_first,
loss_last, num_stages and last_acc_k / last_expected_acceptance_length of
the last stage.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dloop_jax.drafters.block import BlockDrafter
from dloop_jax.drafters.domino import DominoDrafter
from dloop_jax.drafters.dspark import DSparkDrafter
from dloop_jax.drafters.eagle3 import Eagle3Drafter
from dloop_jax.errors import ConfigError
from dloop_jax.training import config as config_lib
from dloop_jax.training import domino_objective
from dloop_jax.training import dspark_objective
from dloop_jax.training import metrics as metrics_lib

OBJECTIVES = ("eagle3_ttt", "block", "dspark", "domino", "loop_aware")
# Distillation settings of every objective but dspark (whose own terms read
# the target's distribution: ce_weight / l1_weight). The defaults are hard
# cross-entropy on the data's tokens.
SOFT_DEFAULTS = {k: v for k, v in config_lib.DISTILLATION_DEFAULTS.items()
                 if k != "feature_noise"}
# Subclasses first: a DSpark or Domino drafter is also a BlockDrafter.
_BASE_FOR = {DSparkDrafter: "dspark", DominoDrafter: "domino", Eagle3Drafter: "eagle3_ttt",
             BlockDrafter: "block"}


# ------------------------------------------------------------------ helpers
def _plain_cfg(cfg: Any) -> dict[str, Any]:
  if cfg is None:
    return {}
  return {k: v for k, v in cfg.items() if v is not None}


def _get(cfg: Any, key: str, default: Any) -> Any:
  if cfg is None:
    return default
  if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
    value = cfg.get(key, None)
    return default if value is None else value
  raise ConfigError(f"objective cfg must be a mapping, got {type(cfg).__name__}.")


def _batch(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Validated batch with int32 ids; segment_ids / positions default to one example per row."""
  missing = [k for k in ("tokens", "loss_mask", "features") if k not in batch]
  if missing:
    raise ConfigError(f"The batch lacks {missing}; it needs tokens, loss_mask, features"
                      " (and segment_ids, positions).")
  tokens = jnp.asarray(batch["tokens"]).astype(jnp.int32)
  b, t = tokens.shape
  segment_ids = batch.get("segment_ids")
  segment_ids = (jnp.ones((b, t), jnp.int32) if segment_ids is None
                 else jnp.asarray(segment_ids).astype(jnp.int32))
  positions = batch.get("positions")
  positions = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if positions is None
               else jnp.asarray(positions).astype(jnp.int32))
  out = dict(tokens=tokens, loss_mask=jnp.asarray(batch["loss_mask"]).astype(jnp.int32),
             features=jnp.asarray(batch["features"]).astype(jnp.float32),
             segment_ids=segment_ids, positions=positions)
  if "target_logits" in batch:
    out["target_logits"] = jnp.asarray(batch["target_logits"]).astype(jnp.float32)
  if "target_topk_ids" in batch and "target_topk_probs" in batch:
    out["target_topk_ids"] = jnp.asarray(batch["target_topk_ids"]).astype(jnp.int32)
    out["target_topk_probs"] = jnp.asarray(batch["target_topk_probs"]).astype(jnp.float32)
  if "target_hidden" in batch:
    out["target_hidden"] = jnp.asarray(batch["target_hidden"]).astype(jnp.float32)
  return out


# ------------------------------------------------------------ soft targets
def soft_settings(cfg: Any) -> dict[str, float]:
  """The distillation weights of `cfg` (`SOFT_DEFAULTS` where unset), validated."""
  out = {}
  for key, default in SOFT_DEFAULTS.items():
    value = _get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
      raise ConfigError(f"objective_cfg.{key} must be a number >= 0, got {value!r}.")
    out[key] = float(value)
  return out


def target_needs(objective: str, cfg: Any, drafter: Any) -> tuple[bool, bool]:
  """(reads the target's distribution, reads its last decoder layer's output).

  What an online step must compute for `objective` with `cfg` on `drafter`:
  the distribution for soft targets (kl_weight / tv_weight) and for DSpark
  (its L1 and confidence terms), the last layer's output for feature
  regression.
  """
  del objective
  soft = soft_settings(cfg)
  distribution = bool(soft["kl_weight"] or soft["tv_weight"]) or isinstance(drafter,
                                                                             DSparkDrafter)
  return distribution, bool(soft["feature_regression_weight"])


def has_target_distribution(batch: Mapping[str, Any]) -> bool:
  return "target_logits" in batch or ("target_topk_ids" in batch and "target_topk_probs" in batch)


def _target_dist(b: Mapping[str, jax.Array], at) -> tuple | None:
  """The target's distribution of each label: ("logits", [..., V]) or ("topk", ids, probs).

  `at` maps a [B, T, ...] array (the target's distribution after reading
  tokens[t]) to the labels' shape (the shift or gather that reads, for each
  label, the distribution after the token before it).
  """
  if "target_logits" in b:
    return ("logits", at(b["target_logits"]))
  if "target_topk_ids" in b:
    return ("topk", at(b["target_topk_ids"]), at(b["target_topk_probs"]))
  return None


def _soft_terms(drafter, logp: jax.Array, dist: tuple) -> tuple[jax.Array, jax.Array]:
  """(KL(p_target || p_draft), TV(p_target, p_draft)) per prediction.

  logp: [..., Vd] the drafter's log-probabilities over its draft vocabulary.
  With a reduced draft vocabulary the target's distribution is renormalized
  over the draft vocabulary (EAGLE-3's training: the target's logits at the
  draft ids, softmaxed), the distribution the drafter can match. Top-k
  targets are the k likeliest tokens renormalized, zero elsewhere.
  """
  reduced = bool(getattr(drafter, "reduced_vocab", False))
  if dist[0] == "logits":
    target_logits = dist[1]
    if reduced:
      target_logits = jnp.take(target_logits, drafter.d2t[...], axis=-1)
    logp_t = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    p_t = jnp.exp(logp_t)
    kl = jnp.sum(p_t * (logp_t - logp), axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(p_t - jnp.exp(logp)), axis=-1)
    return kl, tv
  ids, probs = dist[1], dist[2].astype(jnp.float32)
  if reduced:
    draft_ids = drafter.to_draft_ids(ids)
    probs = jnp.where(draft_ids >= 0, probs, 0.0)
    ids = jnp.maximum(draft_ids, 0)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  p_t = probs / jnp.where(total > 0, total, 1.0)
  logq = jnp.take_along_axis(logp, ids, axis=-1)
  kl = jnp.sum(jnp.where(p_t > 0, p_t * (jnp.log(jnp.where(p_t > 0, p_t, 1.0)) - logq), 0.0),
               axis=-1)
  tv = dspark_objective.topk_total_variation(logp, ids, p_t)
  return kl, tv


def soft_loss(drafter, dist: tuple | None, soft: Mapping[str, float]):
  """`(logits [..., Vd], nll [...]) -> per-prediction loss` of the distillation settings.

  hard_weight * nll + kl_weight * KL + tv_weight * TV; `nll` unchanged when
  only the hard term is on (the default, today's cross-entropy bit for bit).
  """
  kl_w, tv_w, hard_w = soft["kl_weight"], soft["tv_weight"], soft["hard_weight"]
  if kl_w or tv_w:
    if dist is None:
      raise ConfigError("objective_cfg.kl_weight / tv_weight distill the target's distribution,"
                        " which these batches lack: train online (data.online=True), or build"
                        " the dataset with target_topk > 0 (python -m train.data"
                        " --config.target_topk=K).")

  def per_prediction(logits: jax.Array, nll: jax.Array) -> jax.Array:
    out = nll if hard_w == 1.0 else hard_w * nll
    if kl_w or tv_w:
      kl, tv = _soft_terms(drafter, jax.nn.log_softmax(logits, axis=-1), dist)
      out = out + kl_w * kl + tv_w * tv
    return out

  return per_prediction


def noisy_features(features: jax.Array, key: jax.Array, *, scale: float) -> jax.Array:
  """features [..., D] plus Gaussian noise of RMS `scale` times each vector's own RMS."""
  rms = jnp.sqrt(jnp.mean(jnp.square(features.astype(jnp.float32)), axis=-1, keepdims=True))
  noise = jax.random.normal(key, features.shape, jnp.float32) * (scale * rms)
  return (features.astype(jnp.float32) + noise).astype(features.dtype)


def _shift(x: jax.Array, offset: int, fill: int = 0) -> jax.Array:
  """y[:, t] = x[:, t + offset] (fill past the end); x [B, T, ...]."""
  t = x.shape[1]
  if offset >= t:
    return jnp.full_like(x, fill)
  pad = ((0, 0), (0, offset)) + ((0, 0),) * (x.ndim - 2)
  return jnp.pad(x[:, offset:], pad, constant_values=fill)


def _ce_terms(drafter, hidden: jax.Array, labels: jax.Array, valid: jax.Array,
              weights: jax.Array | None = None, per_prediction=None) -> tuple[jax.Array, ...]:
  """Cross-entropy pieces of predictions `hidden` [..., D] of target ids `labels` [...].

  Labels outside a reduced draft vocabulary cannot be drafted: they are left
  out of the loss and counted as misses in the accuracy. The logits are
  recomputed in the backward pass (`jax.checkpoint`) instead of stored: at
  [B, T, Vd] per step they would dominate training memory.

  `per_prediction`: `(logits, nll) -> loss` per prediction (`soft_loss`);
  None = nll.

  Returns:
    (sum of weighted losses, sum of weights of loss terms, correct [...] bool,
    valid [...] bool).
  """
  draft_labels = drafter.to_draft_ids(labels)
  in_vocab = draft_labels >= 0

  @jax.checkpoint
  def nll_and_pred(h):
    logits = drafter.draft_logits(h)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.maximum(draft_labels, 0)[..., None], axis=-1)[..., 0]
    if per_prediction is not None:
      nll = per_prediction(logits, nll)
    return nll, jnp.argmax(logits, axis=-1)

  nll, pred = nll_and_pred(hidden)
  w = (valid & in_vocab).astype(jnp.float32)
  if weights is not None:
    w = w * weights
  correct = (drafter.to_target_ids(pred) == labels) & valid
  return jnp.sum(nll * w), jnp.sum(w), correct, valid


# ------------------------------------------------------------------- EAGLE-3
def _smooth_l1(x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean over the last axis of the smooth-L1 (Huber, delta 1) distance: [..., D] -> [...]."""
  d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
  return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def _ttt_step_stats(drafter: Eagle3Drafter, b: dict[str, jax.Array], num_steps: int, *,
                    soft: Mapping[str, float] | None = None, per_row: bool = False):
  """Per-step (mean loss [K], correct [K], counted [K]) of a `num_steps` TTT unroll.

  `soft`: distillation settings (`soft_settings`; None = hard CE). With
  `feature_regression_weight` step i also regresses the drafter's hidden
  state onto the target's last-layer output after reading tokens[t + 1 + i]
  (EAGLE-1's feature loss: the drafter's state stands for that feature).
  `per_row`: correct and counted [K, B] per row instead.
  """
  tokens, seg = b["tokens"], b["segment_ids"]
  soft = soft or SOFT_DEFAULTS
  hiddens = drafter.ttt_hiddens(tokens=tokens, features=b["features"], positions=b["positions"],
                                segment_ids=seg, num_steps=num_steps)
  t = tokens.shape[1]
  reduce = (lambda x: jnp.sum(x, axis=1)) if per_row else jnp.sum
  losses, correct, counted = [], [], []
  for i in range(num_steps):
    # Step i at index t predicts tokens[t + 2 + i], which the target predicted
    # after reading tokens[t + 1 + i].
    offset = 2 + i
    labels = _shift(tokens, offset)
    valid = ((jnp.arange(t)[None, :] + offset < t) & (_shift(b["loss_mask"], offset) == 1)
             & (_shift(seg, offset, fill=-1) == seg) & (seg > 0))
    dist = _target_dist(b, lambda x, i=i: _shift(x, 1 + i))
    nll_sum, w_sum, ok, val = _ce_terms(drafter, hiddens[i], labels, valid,
                                        per_prediction=soft_loss(drafter, dist, soft))
    loss = metrics_lib.safe_ratio(nll_sum, w_sum)
    if soft["feature_regression_weight"]:
      if "target_hidden" not in b:
        raise ConfigError("objective_cfg.feature_regression_weight regresses onto the target's"
                          " last-layer output, which stored datasets do not hold: train online"
                          " (data.online=True).")
      reg = _smooth_l1(hiddens[i], _shift(b["target_hidden"], 1 + i))
      w = valid.astype(jnp.float32)
      loss = loss + soft["feature_regression_weight"] * metrics_lib.safe_ratio(
          jnp.sum(reg * w), jnp.sum(w))
    losses.append(loss)
    correct.append(reduce(ok))
    counted.append(reduce(val))
  return jnp.stack(losses), jnp.stack(correct), jnp.stack(counted)


def eagle3_ttt_loss(drafter: Eagle3Drafter, batch: Mapping[str, jax.Array], *,
                    ttt_steps: int = 7, step_decay: float = 0.8,
                    soft: Mapping[str, float] | None = None):
  """EAGLE-3 training-time test: sum_i step_decay^i * loss of unrolled step i.

  The loss of a step is CE, or with `soft` (`soft_settings`) the distillation
  terms and the feature regression.
  """
  b = _batch(batch)
  losses, correct, counted = _ttt_step_stats(drafter, b, ttt_steps, soft=soft)
  weights = step_decay ** jnp.arange(ttt_steps, dtype=jnp.float32)
  loss = jnp.sum(weights * losses)
  return loss, {"loss": loss, **metrics_lib.position_metrics(correct, counted)}


def _eagle3_loop_branch(drafter, b, *, stages: int, gamma: int, step_decay: float, soft=None):
  losses, correct, counted = _ttt_step_stats(drafter, b, stages * gamma, soft=soft)
  decay = step_decay ** jnp.arange(gamma, dtype=jnp.float32)
  first = jnp.sum(decay * losses[:gamma])
  last = jnp.sum(decay * losses[-gamma:])
  return _loop_result(first, last, correct[:gamma], counted[:gamma], correct[-gamma:],
                      counted[-gamma:], stages)


# --------------------------------------------------------------------- block
def sample_anchors(key: jax.Array, b: Mapping[str, jax.Array], num_anchors: int
                   ) -> tuple[jax.Array, jax.Array]:
  """Random distinct anchors per row among positions whose next token is a response token.

  An anchor a is valid when tokens[a + 1] is to be predicted (loss_mask 1) in
  a's segment: at inference the anchor is the last committed token, and the
  first draft predicts the next response token.

  Returns:
    anchors [B, A] int32, ok [B, A] bool (False when a row has fewer valid
    positions than A; those blocks count nowhere).
  """
  seg, lm = b["segment_ids"], b["loss_mask"]
  t = seg.shape[1]
  valid = (_shift(lm, 1) == 1) & (_shift(seg, 1, fill=-1) == seg) & (seg > 0)
  valid = valid & (jnp.arange(t)[None, :] < t - 1)
  scores = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
  top, anchors = jax.lax.top_k(scores, num_anchors)
  return anchors.astype(jnp.int32), top >= 0


def _stage_targets(b, anchors, ok, *, stage: int, gamma: int) -> dict[str, jax.Array]:
  """What one stage's gamma drafts predict, all [B, A, gamma].

  Returns:
    labels, valid (bool), weights (exp(-(k - 1) / gamma)), prev (the
    ground-truth token before each label), pos (label index into T, clipped).
  """
  tokens, seg, lm = b["tokens"], b["segment_ids"], b["loss_mask"]
  t = tokens.shape[1]
  k = jnp.arange(1, gamma + 1)
  pos = anchors[..., None] + stage * gamma + k  # [B, A, gamma]
  inside = pos < t
  pos_c = jnp.clip(pos, 0, t - 1)
  take = jax.vmap(lambda row, p: row[p])
  seg_a = jnp.take_along_axis(seg, anchors, axis=1)[..., None]
  valid = inside & (take(lm, pos_c) == 1) & (take(seg, pos_c) == seg_a) & ok[..., None]
  weights = jnp.broadcast_to(jnp.exp(-(k - 1) / gamma).astype(jnp.float32), valid.shape)
  return dict(labels=take(tokens, pos_c), valid=valid, weights=weights,
              prev=take(tokens, pos_c - 1), pos=pos_c)


def _label_dist(b, y) -> tuple | None:
  """The target's distribution of each label of `_stage_targets` (after reading tokens[p - 1])."""
  take = jax.vmap(lambda row, p: row[p])
  return _target_dist(b, lambda x: take(x, y["pos"] - 1))


def _block_stage_stats(drafter: BlockDrafter, b, anchors, ok, h: jax.Array, *, stage: int,
                       gamma: int, cfg: Any = None, per_row: bool = False):
  """(weighted mean loss, correct [gamma], counted [gamma]) of one stage's outputs h [B, A, gamma, D].

  `per_row`: correct and counted [B, gamma] per row instead.
  """
  y = _stage_targets(b, anchors, ok, stage=stage, gamma=gamma)
  per_prediction = soft_loss(drafter, _label_dist(b, y), soft_settings(cfg))
  nll_sum, w_sum, correct, valid = _ce_terms(drafter, h, y["labels"], y["valid"], y["weights"],
                                             per_prediction=per_prediction)
  axes = 1 if per_row else (0, 1)
  return (metrics_lib.safe_ratio(nll_sum, w_sum), jnp.sum(correct, axis=axes),
          jnp.sum(valid, axis=axes))


def _head_stage_stats(drafter, b, anchors, ok, h: jax.Array, *, stage: int, gamma: int,
                      cfg: Any = None, progress: jax.Array | None = None,
                      extras: list | None = None, per_row: bool = False):
  """`_block_stage_stats` for DSpark / Domino (their own objectives); metrics go to `extras`."""
  y = _stage_targets(b, anchors, ok, stage=stage, gamma=gamma)
  common = dict(labels=y["labels"], prev=y["prev"], valid=y["valid"], weights=y["weights"])
  if isinstance(drafter, DSparkDrafter):
    target_probs = target_topk = None
    # The target's distribution after reading tokens[p - 1] is that of tokens[p].
    take = jax.vmap(lambda row, p: row[p])
    if "target_logits" in b:
      target_probs = jax.nn.softmax(take(b["target_logits"], y["pos"] - 1), axis=-1)
    elif "target_topk_ids" in b:
      target_topk = (take(b["target_topk_ids"], y["pos"] - 1),
                     take(b["target_topk_probs"], y["pos"] - 1))
    weights = {k: float(_get(cfg, k, v)) for k, v in dspark_objective.DEFAULTS.items()}
    loss, correct, m = dspark_objective.stage_loss(drafter, h, target_probs=target_probs,
                                                   target_topk=target_topk, cfg=weights,
                                                   **common)
  else:
    lam = domino_objective.base_weight(progress, float(_get(cfg, "curriculum_fraction", 0.5)))
    soft = soft_settings(cfg)
    per_prediction = (None if soft == SOFT_DEFAULTS
                      else soft_loss(drafter, _label_dist(b, y), soft))
    loss, correct, m = domino_objective.stage_loss(drafter, h, lam=lam,
                                                   per_prediction=per_prediction, **common)
  if extras is not None:
    extras.append(m)
  axes = 1 if per_row else (0, 1)
  return loss, jnp.sum(correct, axis=axes), jnp.sum(y["valid"], axis=axes)


def _stage_stats_for(drafter, cfg, progress, extras=None, per_row=False):
  if isinstance(drafter, (DSparkDrafter, DominoDrafter)):
    return functools.partial(_head_stage_stats, cfg=cfg, progress=progress, extras=extras,
                             per_row=per_row)
  return functools.partial(_block_stage_stats, cfg=cfg, per_row=per_row)


def _block_setup(drafter: BlockDrafter, batch, key, cfg):
  b = _batch(batch)
  gamma = int(_get(cfg, "block_size", drafter.block_size))
  if gamma > drafter.block_size:
    raise ConfigError(f"block_size {gamma} exceeds the drafter's block size {drafter.block_size}.")
  num = int(min(_get(cfg, "anchors_per_sequence", 16), b["tokens"].shape[1]))
  anchors, ok = sample_anchors(key, b, num)
  return b, gamma, anchors, ok


def block_loss(drafter: BlockDrafter, batch: Mapping[str, jax.Array], key: jax.Array, *,
               cfg: Any = None, progress: jax.Array | None = None):
  """Block objective: random anchors, position-decayed CE over the block.

  On a DSpark or Domino drafter the same anchors and blocks with that
  drafter's objective (the `dspark` / `domino` objectives).
  """
  b, gamma, anchors, ok = _block_setup(drafter, batch, key, cfg)
  (h,) = drafter.train_stages(tokens=b["tokens"], features=b["features"],
                              positions=b["positions"], segment_ids=b["segment_ids"],
                              anchors=anchors, block_size=gamma, num_stages=1)
  extras = []
  stats = _stage_stats_for(drafter, cfg, progress, extras)
  loss, correct, counted = stats(drafter, b, anchors, ok, h, stage=0, gamma=gamma)
  metrics = {"loss": loss, **metrics_lib.position_metrics(correct, counted)}
  for m in extras:
    metrics.update(m)
  return loss, metrics


def _block_loop_branch(drafter, b, anchors, ok, *, stages: int, gamma: int, stats):
  hs = drafter.train_stages(tokens=b["tokens"], features=b["features"], positions=b["positions"],
                            segment_ids=b["segment_ids"], anchors=anchors, block_size=gamma,
                            num_stages=stages)
  first, c1, n1 = stats(drafter, b, anchors, ok, hs[0], stage=0, gamma=gamma)
  last, cs, ns = stats(drafter, b, anchors, ok, hs[-1], stage=stages - 1, gamma=gamma)
  return _loop_result(first, last, c1, n1, cs, ns, stages)


# ---------------------------------------------------------------- loop-aware
def _loop_result(first, last, c1, n1, cs, ns, stages):
  loss = 0.5 * (first + last)
  m = {"loss": loss, "loss_first": first, "loss_last": last,
       "num_stages": jnp.asarray(stages, jnp.float32)}
  m.update(metrics_lib.position_metrics(c1, n1))
  m.update(metrics_lib.position_metrics(cs, ns, prefix="last_"))
  return loss, m


def loop_aware_loss(drafter, batch: Mapping[str, jax.Array], key: jax.Array, *, cfg: Any = None,
                    progress: jax.Array | None = None):
  """Loop-aware training: (L^(1) + L^(S)) / 2, S ~ U{1..N} (docs/design.md §Loop-aware training)."""
  n = int(_get(cfg, "loop_stages", _get(cfg, "max_stages", 3)))
  if n < 1:
    raise ConfigError(f"loop_stages must be >= 1, got {n}.")
  fixed = int(_get(cfg, "fixed_stages", 0))
  if not 0 <= fixed <= n:
    raise ConfigError(f"fixed_stages must be in [0, loop_stages={n}], got {fixed}.")
  # Anchors from `key` itself: with S = 1 this is exactly the block objective.
  stage_key, anchor_key = jax.random.fold_in(key, 1), key
  index = (jnp.asarray(fixed - 1, jnp.int32) if fixed
           else jax.random.randint(stage_key, (), 0, n))  # S - 1
  if isinstance(drafter, Eagle3Drafter):
    b = _batch(batch)
    gamma = int(_get(cfg, "block_size", drafter.block_size))
    decay = float(_get(cfg, "step_decay", 0.8))
    soft = soft_settings(cfg)
    branches = [lambda s=s: _eagle3_loop_branch(drafter, b, stages=s, gamma=gamma,
                                                step_decay=decay, soft=soft)
                for s in range(1, n + 1)]
  else:
    b, gamma, anchors, ok = _block_setup(drafter, batch, anchor_key, cfg)
    # The fine-tune starts from a trained drafter: no base-anchored curriculum
    # unless the config asks for one.
    cfg = dict(_plain_cfg(cfg))
    cfg.setdefault("curriculum_fraction", 0.0)
    stats = _stage_stats_for(drafter, cfg, progress)
    branches = [lambda s=s: _block_loop_branch(drafter, b, anchors, ok, stages=s, gamma=gamma,
                                               stats=stats) for s in range(1, n + 1)]
  if fixed:
    return branches[fixed - 1]()
  return jax.lax.switch(index, branches)


# ---------------------------------------------------------------------- entry
def loss_fn(drafter, batch: Mapping[str, jax.Array], key: jax.Array, *, objective: str,
            cfg: Any = None, progress: jax.Array | float | None = None
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss of `drafter` on `batch` and its metrics.

  Args:
    drafter: an `Eagle3Drafter`, `BlockDrafter`, `DSparkDrafter` or `DominoDrafter`
      (merged from trained params).
    batch: see the module docstring.
    key: PRNG key (anchors, loop stages).
    objective: "eagle3_ttt", "block", "dspark", "domino" or "loop_aware".
    cfg: the objective's settings (see the module docstring).
    progress: fraction of training done (traced scalar in [0, 1]): Domino's
      curriculum; None = past it.

  Returns:
    (scalar loss, {name: scalar metric}).
  """
  if objective not in OBJECTIVES:
    raise ConfigError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
  base = next((name for cls, name in _BASE_FOR.items() if isinstance(drafter, cls)), None)
  if base is None:
    raise ConfigError(f"No objective trains a {type(drafter).__name__}; expected an EAGLE-3,"
                      " block, DSpark or Domino drafter.")
  if base in config_lib.FULL_VOCAB_KINDS and drafter.reduced_vocab:
    # Their losses would index Vd logits with target ids.
    config_lib.check_draft_vocab(base, drafter.spec.draft_vocab_size)
  soft = soft_settings(cfg)
  if base == "dspark" and soft != SOFT_DEFAULTS:
    raise ConfigError("A dspark drafter distills the target's distribution with its own terms:"
                      " set objective_cfg.ce_weight / l1_weight (not"
                      f" {sorted(k for k in SOFT_DEFAULTS if soft[k] != SOFT_DEFAULTS[k])}).")
  if soft["feature_regression_weight"] and base != "eagle3_ttt":
    raise ConfigError("objective_cfg.feature_regression_weight regresses an EAGLE-3 drafter's"
                      f" hidden state onto the target's next feature; a {base} drafter has none.")
  if (soft["kl_weight"] or soft["tv_weight"]) and not has_target_distribution(batch):
    soft_loss(drafter, None, soft)  # raises: what to do about it
  noise = _get(cfg, "feature_noise", 0.0)
  if isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not noise >= 0:
    raise ConfigError(f"feature_noise must be a number >= 0 (0 = none), got {noise!r}.")
  if noise:
    # A stream of its own: the anchors and stages drawn from `key` stay the same.
    batch = dict(batch, features=noisy_features(jnp.asarray(batch["features"]),
                                                jax.random.fold_in(key, 0x6E6F6973),
                                                scale=float(noise)))
  if objective == "loop_aware":
    wanted = _get(cfg, "base_objective", base)
    if wanted != base:
      raise ConfigError(f"loop_aware with base_objective={wanted!r} does not fit a"
                        f" {type(drafter).__name__} (its objective is {base!r}).")
    return loop_aware_loss(drafter, batch, key, cfg=cfg, progress=progress)
  if objective != base:
    raise ConfigError(f"objective {objective!r} does not train a {type(drafter).__name__}; use"
                      f" {base!r} (or 'loop_aware').")
  if objective == "eagle3_ttt":
    return eagle3_ttt_loss(drafter, batch, ttt_steps=int(_get(cfg, "ttt_steps", 7)),
                           step_decay=float(_get(cfg, "step_decay", 0.8)),
                           soft=soft_settings(cfg))
  return block_loss(drafter, batch, key, cfg=cfg, progress=progress)


# ------------------------------------------------------------------ held out
def teacher_forced_counts(drafter, batch: Mapping[str, jax.Array], key: jax.Array, *,
                          objective: str, cfg: Any = None) -> tuple[jax.Array, jax.Array]:
  """Per-row teacher-forced hits of draft positions 1..K: (correct [B, K], counted [B, K]).

  What the objective's acc_k count, per row (one held-out example per row):
  EAGLE-3 the K = ttt_steps (loop-aware: gamma) unrolled steps at every
  position, block drafters gamma drafts at `anchors_per_sequence` anchors
  drawn from `key` (a fixed key gives the same anchors at every evaluation,
  so evaluations of one run are paired). Loop-aware objectives are measured
  on their base objective's first stage.
  """
  b = _batch(batch)
  if isinstance(drafter, Eagle3Drafter):
    k = (int(_get(cfg, "block_size", drafter.block_size)) if objective == "loop_aware"
         else int(_get(cfg, "ttt_steps", 7)))
    _, correct, counted = _ttt_step_stats(drafter, b, k, soft=soft_settings(cfg), per_row=True)
    return correct.T, counted.T
  cfg = dict(_plain_cfg(cfg))
  cfg.setdefault("curriculum_fraction", 0.0)  # Domino: the corrected drafts
  b, gamma, anchors, ok = _block_setup(drafter, batch, key, cfg)
  (h,) = drafter.train_stages(tokens=b["tokens"], features=b["features"],
                              positions=b["positions"], segment_ids=b["segment_ids"],
                              anchors=anchors, block_size=gamma, num_stages=1)
  stats = _stage_stats_for(drafter, cfg, None, per_row=True)
  _, correct, counted = stats(drafter, b, anchors, ok, h, stage=0, gamma=gamma)
  return correct, counted
