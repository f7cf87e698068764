"""Reduced draft vocabularies: the most frequent target tokens of the training data.

A drafter with a draft vocabulary of `Vd` ids predicts over those only (a
smaller LM head: less compute per drafting step). Two maps connect them:

    d2t [Vd] int32   draft id -> target id (ascending target ids)
    t2d [V]  int32   target id -> draft id, -1 for tokens outside the draft vocabulary

A target token outside the draft vocabulary can never be drafted: when the
target emits it, the draft there is rejected.
"""

from __future__ import annotations

import numpy as np

from dloop_jax.errors import ConfigError


def token_counts(tokens: np.ndarray, mask: np.ndarray | None = None, *,
                 vocab_size: int) -> np.ndarray:
  """How often each target id occurs where `mask` is set.

  Args:
    tokens: [...] int token ids.
    mask: same shape; count only where nonzero (e.g. a batch's `loss_mask`:
      the tokens drafters have to predict). None counts everything.
    vocab_size: V.

  Returns:
    [V] int64 counts.
  """
  tokens = np.asarray(tokens).reshape(-1)
  if mask is not None:
    tokens = tokens[np.asarray(mask).reshape(-1) != 0]
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ConfigError(f"Token ids must be in [0, {vocab_size}); got {tokens.min()}..{tokens.max()}.")
  return np.bincount(tokens, minlength=vocab_size).astype(np.int64)


def draft_vocab_from_counts(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
  """The `size` most frequent target tokens as a draft vocabulary.

  Ties (including never-seen tokens, to fill up the vocabulary) go to the
  lower id, so the result is deterministic.

  Args:
    counts: [V] token counts (`token_counts`).
    size: draft vocabulary size Vd (1 <= Vd <= V).

  Returns:
    (d2t [Vd] int32 ascending target ids, t2d [V] int32 with -1 outside).
  """
  counts = np.asarray(counts)
  if counts.ndim != 1:
    raise ConfigError(f"counts must be a [vocab_size] array, got shape {counts.shape}.")
  v = counts.shape[0]
  if not 1 <= size <= v:
    raise ConfigError(f"draft vocabulary size must be in [1, {v}], got {size}.")
  # Stable sort of -counts: equal counts keep ascending id order.
  order = np.argsort(-counts.astype(np.float64), kind="stable")
  d2t = np.sort(order[:size]).astype(np.int32)
  t2d = np.full((v,), -1, np.int32)
  t2d[d2t] = np.arange(size, dtype=np.int32)
  return d2t, t2d


def identity_vocab(size: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Placeholder maps before token counts are known: the first `size` ids."""
  return draft_vocab_from_counts(np.zeros((vocab_size,), np.int64), size)
