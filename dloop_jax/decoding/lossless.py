"""Lossless, in floating point: the near-tie rule (docs/design.md §The near-tie rule).

Greedy speculative decoding reproduces greedy autoregressive decoding in exact
arithmetic. A verification forward over T tokens may differ from T single-token
forwards in the last bits, which can flip an argmax where the target's two best
logits (nearly) tie. Two greedy outputs therefore count as the same when they
are identical, or when they first differ at a position where the target's top-2
logit gap is below `NEAR_TIE` (after the flip they continue different texts).

    reference  a b c d e            compare(...) -> identical
    output     a b c d e

    reference  a b c d e            compare(...) -> first_difference 2; lossless
    output     a b x y              iff top-2 gap after [prompt, a, b] < NEAR_TIE
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from dloop_jax.models.transformer import Transformer

# f32 logits of a verification forward and of single-token forwards differ by
# ~1e-5 on the default model; a flip needs the two best logits closer than that.
NEAR_TIE = 1e-3
# With bf16 compute (a target whose `dtype` is bf16) a hidden state that rounds
# to a neighbouring bf16 value (8 significant bits) in one forward and not the
# other moves the logits by up to ~3e-2 (measured, tiny test target: the
# read-only verification against single-token steps); 2^-4 is one bf16 step of
# a logit between 8 and 16.
NEAR_TIE_BF16 = 2.0 ** -4


def near_tie(target: Transformer) -> float:
  """The near-tie bound for `target`'s compute dtype (f32: `NEAR_TIE`, bf16: `NEAR_TIE_BF16`)."""
  return NEAR_TIE_BF16 if jnp.dtype(target.dtype) == jnp.bfloat16 else NEAR_TIE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """How an output compares with a reference greedy output.

  Attributes:
    identical: the two token sequences are equal.
    first_difference: index (in the new tokens) of the first differing token,
      or the shorter length when one is a strict prefix of the other; None if
      identical.
    top2_gap: the target's top-2 logit gap at `first_difference` (None if
      identical or if one output is a strict prefix of the other).
    tolerance: the near-tie bound used.
  """

  identical: bool
  first_difference: int | None = None
  top2_gap: float | None = None
  tolerance: float = NEAR_TIE

  @property
  def lossless(self) -> bool:
    """Identical, or different only after a near-tie of the target."""
    return self.identical or (self.top2_gap is not None and self.top2_gap < self.tolerance)


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
  """Index of the first differing token (the shorter length for a strict prefix); None if equal."""
  expected, got = list(expected), list(got)
  if expected == got:
    return None
  n = min(len(expected), len(got))
  return next((i for i in range(n) if expected[i] != got[i]), n)


def top2_gap(target: Transformer, context: Sequence[int]) -> float:
  """Gap between the target's two largest next-token logits after `context` (one plain forward)."""
  tokens = jnp.asarray([list(context)], jnp.int32)
  t = tokens.shape[1]
  cache = target.init_cache(batch_size=1, capacity=t)
  logits = target(tokens, positions=jnp.arange(t)[None], cache=cache,
                  logit_positions=jnp.asarray([[t - 1]])).logits
  top = np.sort(np.asarray(logits[0, -1], np.float64))[-2:]
  return float(top[1] - top[0])


def compare(target: Transformer, prompt: Sequence[int], expected: Sequence[int],
            got: Sequence[int], *, tolerance: float | None = None) -> Comparison:
  """Compares `got` with the reference greedy output `expected` of the same prompt.

  Args:
    target: the target both outputs come from.
    prompt: the prompt's token ids.
    expected: reference new tokens (autoregressive greedy).
    got: new tokens to check.
    tolerance: near-tie bound on the top-2 logit gap (None: `near_tie(target)`).

  Returns:
    A `Comparison`; `.lossless` is the verdict.
  """
  if tolerance is None:
    tolerance = near_tie(target)
  first = first_difference(expected, got)
  if first is None:
    return Comparison(identical=True, tolerance=tolerance)
  if first >= min(len(expected), len(got)):
    # Same tokens, different lengths: a stop or a budget was handled differently.
    return Comparison(identical=False, first_difference=first, tolerance=tolerance)
  gap = top2_gap(target, list(prompt) + list(expected[:first]))
  return Comparison(identical=False, first_difference=first, top2_gap=gap, tolerance=tolerance)
