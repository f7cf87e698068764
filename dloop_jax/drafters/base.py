"""The variable types of drafters' weights (the protocol they implement is the engine's:
`dloop_jax.decoding.drafter`)."""

from __future__ import annotations

from flax import nnx


class Frozen(nnx.Variable):
  """A weight shared with the target (its embedding, LM head): never trained.

  Not an `nnx.Param`, so `nnx.split(drafter, nnx.Param, ...)` and optimizers
  built over `nnx.Param` leave it alone, and drafter exports do not store it
  (loading takes it from the target again).
  """


class VocabMap(nnx.Variable):
  """An integer vocabulary map (draft <-> target ids): stored, never trained."""
