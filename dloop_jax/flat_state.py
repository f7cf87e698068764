"""nnx.State <-> {flat key: array}: the layout of checkpoints, exports and placed training state.

A flat key joins a variable's path with "/" ("layers/0/kernel").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx


def flat_key(path: Sequence[Any]) -> str:
  """A state path as a checkpoint-friendly string key ("layers/0/kernel")."""
  return "/".join(str(p) for p in path)


def flat_values(state: nnx.State) -> dict[str, Any]:
  """nnx.State -> {flat key: array}."""
  return {flat_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def with_values(state: nnx.State, values: Mapping[str, Any]) -> nnx.State:
  """`state` with each variable's array replaced by `values[flat key]` (metadata kept)."""
  return nnx.from_flat_state([(path, var.replace(values[flat_key(path)]))
                              for path, var in nnx.to_flat_state(state)])
