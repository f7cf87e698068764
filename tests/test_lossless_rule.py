"""`dloop_jax.decoding.lossless`: the near-tie rule the benchmark and tests apply."""

from __future__ import annotations

import numpy as np
import pytest

from dloop_jax.decoding import generate, lossless
from reference import last_logits


def test_first_difference():
  assert lossless.first_difference([1, 2, 3], [1, 2, 3]) is None
  assert lossless.first_difference([1, 2, 3], [1, 5, 3]) == 1
  assert lossless.first_difference([1, 2, 3], [1, 2]) == 2  # strict prefix: the shorter length


def test_compare_measures_the_gap_where_outputs_split(tiny):
  prompt = [3, 1, 4, 1, 5]
  ar = generate(tiny, [prompt], max_new_tokens=8).tokens[0]
  assert lossless.compare(tiny, prompt, ar, list(ar)).identical
  # Swap the third token for the target's runner-up there: not a near-tie on this target.
  logits = last_logits(tiny, [prompt + ar[:2]])[0]
  runner_up = int(np.argsort(logits)[-2])
  changed = ar[:2] + [runner_up] + ar[3:]
  cmp = lossless.compare(tiny, prompt, ar, changed)
  gap = float(np.sort(logits)[-1] - np.sort(logits)[-2])
  assert (cmp.identical, cmp.first_difference) == (False, 2)
  assert cmp.top2_gap == pytest.approx(gap, rel=1e-5)
  assert cmp.lossless == (gap < lossless.NEAR_TIE)
  assert lossless.compare(tiny, prompt, ar, changed, tolerance=gap * 2).lossless
  # Same tokens, different lengths: never lossless.
  short = lossless.compare(tiny, prompt, ar, ar[:-1])
  assert not short.lossless and short.top2_gap is None
