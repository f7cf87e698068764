"""The near-tie rule of lossless comparisons (docs/design.md §The near-tie rule), as a test assertion.

`dloop_jax.decoding.lossless` holds the rule; this helper also accepts the
transformers (PyTorch) reference as the target whose logit gap decides.
"""

from __future__ import annotations

import numpy as np

from dloop_jax.decoding.lossless import NEAR_TIE, first_difference
from reference import last_logits


def top2_gap(target, context: list[int]) -> float:
  """Gap between the two largest next-token logits after `context`."""
  top = np.sort(last_logits(target, [context])[0])[-2:]
  return float(top[1] - top[0])


def assert_same_or_near_tie(target, prompt: list[int], expected: list[int], got: list[int],
                            *, tol: float = NEAR_TIE) -> None:
  """Token sequences are equal, or first differ at a near-tie of the target."""
  first = first_difference(expected, got)
  if first is None:
    return
  assert first < min(len(expected), len(got)), (
      f"lengths differ without a token difference: {expected} vs {got}")
  gap = top2_gap(target, prompt + expected[:first])
  assert gap < tol, (f"outputs differ at new token {first} where the target's top-2 logit gap is"
                     f" {gap:.3g} (not a near-tie): expected {expected} got {got}")
