"""A held-out metric with error bars: teacher-forced acceptance on examples never trained on.

    correct, counted = objectives.teacher_forced_counts(...)   # [N, K] per example
    summary = summarize(correct, counted)
    # {"heldout_acc_1": ..., "heldout_acc_1_se": ..., "heldout_tau": ...,
    #  "heldout_tau_se": ..., "heldout_examples": N}

acc_k pools the examples' hits at draft position k (sum of hits over sum of
predictions), and tau = 1 + sum_k prod_{j <= k} acc_j is the acceptance
length they imply for one verification of K drafts
(`metrics.expected_acceptance_length`). The standard errors are the
delete-one jackknife over examples: the examples are the independent units
(positions of one example are not), and the jackknife carries the ratio and
the product without a variance formula for each.

The examples are the last `data.heldout_examples` of the training split,
which training never reads (`pipeline.heldout_batches`): the same domain as
the training data, unlike the benchmark prompts engine tau is measured on.
"""

from __future__ import annotations

import numpy as np


def _tau(acc: np.ndarray) -> np.ndarray:
  """[..., K] accuracies -> [...] 1 + sum_k prod_{j <= k} acc_j."""
  return 1.0 + np.sum(np.cumprod(acc, axis=-1), axis=-1)


def summarize(correct: np.ndarray, counted: np.ndarray, *, prefix: str = "heldout_"
              ) -> dict[str, float]:
  """Pooled acc_k and tau over examples, with jackknife standard errors.

  Args:
    correct: [N, K] hits of each example at draft positions 1..K.
    counted: [N, K] predictions counted there; examples with none are left
      out (nothing of theirs was predicted).
    prefix: metric name prefix.

  Returns:
    {prefix + "acc_k", "acc_k_se" (k = 1..K), "tau", "tau_se", "examples"}.
  """
  correct = np.asarray(correct, np.float64)
  counted = np.asarray(counted, np.float64)
  keep = counted.sum(axis=1) > 0
  correct, counted = correct[keep], counted[keep]
  n, k = counted.shape
  total_c, total_n = correct.sum(axis=0), counted.sum(axis=0)
  acc = np.divide(total_c, total_n, out=np.zeros(k), where=total_n > 0)
  out: dict[str, float] = {}
  if n > 1:
    # Leave-one-out pooled accuracies [N, K] and their tau [N].
    loo_n = total_n[None] - counted
    loo_acc = np.divide(total_c[None] - correct, loo_n, out=np.zeros_like(loo_n),
                        where=loo_n > 0)
    scale = (n - 1) / n
    acc_se = np.sqrt(scale * np.sum((loo_acc - loo_acc.mean(axis=0)) ** 2, axis=0))
    loo_tau = _tau(loo_acc)
    tau_se = float(np.sqrt(scale * np.sum((loo_tau - loo_tau.mean()) ** 2)))
  else:
    acc_se, tau_se = np.full(k, np.nan), float("nan")
  for j in range(k):
    out[f"{prefix}acc_{j + 1}"] = float(acc[j])
    out[f"{prefix}acc_{j + 1}_se"] = float(acc_se[j])
  out[f"{prefix}tau"] = float(_tau(acc))
  out[f"{prefix}tau_se"] = tau_se
  out[f"{prefix}examples"] = int(n)
  return out
