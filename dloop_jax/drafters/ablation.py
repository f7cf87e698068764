"""A trained drafter with one of its heads switched off, for ablations.

DSpark's Markov head and Domino's correction head each add a term to the
backbone's draft logits, and each has a zero-initialised output matrix (an
untrained head leaves the backbone's logits unchanged). Zeroing that matrix
in a copy of a trained drafter therefore removes exactly the head's term:

    no_markov = without_head(dspark, "markov")         # backbone logits only
    no_correction = without_head(domino, "correction")  # the base logits only

Everything else (backbone, vocabulary maps, confidence head) is the trained
drafter's, so the engine τ of the copy against the original's is the head's
contribution at inference (`python -m train.evaluate --heads-off`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dloop_jax.errors import ConfigError

# head -> (drafter name, the parameter whose rows are the head's output)
HEADS: dict[str, tuple[str, str]] = {
    "markov": ("dspark", "markov_w2"),
    "correction": ("domino", "correction_w2"),
}


def heads(drafter: nnx.Module) -> tuple[str, ...]:
  """The heads of `drafter` that `without_head` can switch off (may be empty)."""
  return tuple(head for head, (_, param) in HEADS.items()
               if getattr(drafter, param, None) is not None)


def without_head(drafter: nnx.Module, head: str) -> nnx.Module:
  """A copy of `drafter` whose `head` adds nothing to the draft logits.

  Args:
    drafter: a trained drafter (left unchanged).
    head: one of `heads(drafter)`.

  Raises:
    ConfigError: `drafter` has no head of that name.
  """
  if head not in HEADS:
    raise ConfigError(f"Unknown head {head!r}; the heads that can be switched off are"
                      f" {sorted(HEADS)}.")
  kind, param = HEADS[head]
  if head not in heads(drafter):
    have = ", ".join(heads(drafter)) or "none"
    raise ConfigError(f"The {getattr(drafter, 'name', type(drafter).__name__)} drafter has no"
                      f" {head} head (that is a {kind} drafter's; this one's: {have}).")
  copy = nnx.clone(drafter)
  weights = getattr(copy, param)
  weights.set_value(jnp.zeros_like(weights.get_value()))
  return copy
