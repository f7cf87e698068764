"""The near-tie rule of lossless comparisons (DESIGN.md §4)."""

from __future__ import annotations

import numpy as np

from reference import last_logits

NEAR_TIE = 1e-3


def top2_gap(target, context: list[int]) -> float:
  """Gap between the two largest next-token logits after `context`."""
  top = np.sort(last_logits(target, [context])[0])[-2:]
  return float(top[1] - top[0])


def assert_same_or_near_tie(target, prompt: list[int], expected: list[int], got: list[int],
                            *, tol: float = NEAR_TIE) -> None:
  """Token sequences are equal, or first differ at a near-tie of the target."""
  if expected == got:
    return
  n = min(len(expected), len(got))
  first = next((i for i in range(n) if expected[i] != got[i]), n)
  assert first < n, f"lengths differ without a token difference: {expected} vs {got}"
  gap = top2_gap(target, prompt + expected[:first])
  assert gap < tol, (f"outputs differ at new token {first} where the target's top-2 logit gap is"
                     f" {gap:.3g} (not a near-tie): expected {expected} got {got}")
