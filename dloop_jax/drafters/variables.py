"""A drafter's variables by role, and filling them from stored arrays.

    params       nnx.Param: trained, stored (exports, checkpoints)
    frozen       `Frozen`: weights shared with the target, never trained nor stored
    rng          RNG streams
    model_state  everything else (e.g. vocabulary maps), stored

Exports (`io`), the Hugging Face readers (`hf_format`) and the trainer split
drafters and load their weights through these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax import flat_state
from dloop_jax import plain_values
from dloop_jax.drafters.base import Frozen
from dloop_jax.errors import ConfigError, ModelLoadError


def split_drafter(drafter: nnx.Module) -> tuple[Any, nnx.State, nnx.State, nnx.State, nnx.State]:
  """(graphdef, params, frozen, rng, model_state) of a drafter (see the module docstring)."""
  # Frozen first: it wins should a drafter's frozen type also subclass Param.
  graphdef, frozen, params, rng, model_state = nnx.split(
      drafter, Frozen, nnx.Param, nnx.RngState, ...)
  return graphdef, params, frozen, rng, model_state


def is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                        jnp.floating)


def drafter_config_of(drafter: nnx.Module) -> dict[str, Any]:
  """The config `build_drafter` rebuilds `drafter` from, as plain JSON values."""
  fn = getattr(drafter, "drafter_config", None)
  if fn is None:
    raise ConfigError(f"Drafter {type(drafter).__name__} has no drafter_config(); it cannot be"
                      " exported (load_drafter rebuilds drafters from it).")
  return plain_values.to_plain(fn())


def assign(state: nnx.State, values: Mapping[str, Any], *, dtype: Any, what: str,
           source: str) -> nnx.State:
  """`state` with its arrays replaced by `values` (floats cast to `dtype`).

  Raises:
    ModelLoadError: names or shapes differ.
  """
  current = flat_state.flat_values(state)
  missing = sorted(set(current) - set(values))
  unexpected = sorted(set(values) - set(current))
  if missing or unexpected:
    raise ModelLoadError(f"{what} in {source} do not fit the drafter its config builds:"
                         f" missing {missing}, unexpected {unexpected}.")
  cast = {}
  for k, v in values.items():
    if tuple(np.shape(v)) != tuple(np.shape(current[k])):
      raise ModelLoadError(f"{what} {k!r} in {source} has shape {tuple(np.shape(v))}, the"
                           f" drafter needs {tuple(np.shape(current[k]))}.")
    want = dtype if is_float(current[k]) else current[k].dtype
    # Cast on the host: a device cast compiles one program per shape and dtype.
    cast[k] = jnp.asarray(np.asarray(v).astype(np.dtype(want), copy=False))
  return flat_state.with_values(state, cast)
