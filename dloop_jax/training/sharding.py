"""Logical axis rules and `NamedSharding`s for training state.

The mesh is `dloop_jax.mesh`'s (axes data, fsdp, tensor). A parameter's
`PartitionSpec` comes from, in order:

  1. its `out_sharding` metadata (`nnx.with_partitioning` / `nnx.Param(...,
     out_sharding=...)`): logical axis names mapped to mesh axes by the rules
     table (`config.sharding.rules`), names that already are mesh axes kept;
  2. otherwise a shape heuristic: split the largest dimension divisible by the
     fsdp size over `fsdp`, and another dimension divisible by the tensor size
     over `tensor`. GSPMD keeps any placement numerically correct, so the
     heuristic only decides memory and communication, never the result.

Batches are split over `("data", "fsdp")` on their leading axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dloop_jax import flat_state
from dloop_jax import mesh as mesh_lib
from dloop_jax.errors import ConfigError

BATCH_AXES = ("data", "fsdp")

# Arrays below this many elements stay replicated under the heuristic:
# splitting a norm scale saves nothing and costs a gather per use.
DEFAULT_MIN_SHARD_SIZE = 1024


def normalize_rules(rules: Sequence[Sequence[Any]] | None) -> tuple[tuple[str, Any], ...]:
  """Config rules (lists from JSON / the command line) -> tuple of (name, axes) pairs."""
  if rules is None:
    return mesh_lib.DEFAULT_RULES
  out = []
  for rule in rules:
    if len(rule) != 2:
      raise ConfigError(f"A sharding rule is a (logical name, mesh axes) pair, got {rule!r}.")
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    for a in (axes if isinstance(axes, tuple) else (axes,)):
      if a is not None and a not in mesh_lib.MESH_AXES:
        raise ConfigError(f"Sharding rule {rule!r} names mesh axis {a!r}; mesh axes are"
                          f" {list(mesh_lib.MESH_AXES)}.")
    out.append((str(name), axes))
  return tuple(out)


def logical_to_spec(names: Sequence[str | None], *, rules: Sequence[tuple[str, Any]],
                    mesh: Mesh, shape: Sequence[int] | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec over `mesh`.

  A mesh axis is used at most once (the first dimension claiming it wins), and
  mesh axes that do not divide the dimension are dropped, so a valid spec
  always comes out.
  """
  table = dict(rules)
  used: set[str] = set()
  out: list[Any] = []
  for i, name in enumerate(names):
    if name is None:
      out.append(None)
      continue
    axes = table.get(name, name if name in mesh_lib.MESH_AXES else None)
    axes = axes if isinstance(axes, tuple) else ((axes,) if axes is not None else ())
    keep = []
    size = 1
    for a in axes:
      if a in used or mesh.shape[a] == 1:
        continue
      if shape is not None and shape[i] % (size * mesh.shape[a]):
        continue
      keep.append(a)
      size *= mesh.shape[a]
    used.update(keep)
    out.append(None if not keep else (keep[0] if len(keep) == 1 else tuple(keep)))
  return PartitionSpec(*out)


def heuristic_spec(shape: Sequence[int], *, mesh: Mesh,
                   min_size: int = DEFAULT_MIN_SHARD_SIZE) -> PartitionSpec:
  """fsdp on the largest divisible dimension, tensor on the next one."""
  spec: list[Any] = [None] * len(shape)
  if not shape or math.prod(shape) < min_size:
    return PartitionSpec(*spec)
  order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
  for axis in ("fsdp", "tensor"):
    n = mesh.shape[axis]
    if n == 1:
      continue
    for i in order:
      if spec[i] is None and shape[i] % n == 0:
        spec[i] = axis
        break
  return PartitionSpec(*spec)


def variable_spec(variable: nnx.Variable, *, mesh: Mesh, rules: Sequence[tuple[str, Any]],
                  min_size: int = DEFAULT_MIN_SHARD_SIZE) -> PartitionSpec:
  """PartitionSpec of one NNX variable (annotation first, then heuristic)."""
  value = variable.get_value()
  shape = tuple(getattr(value, "shape", ()))
  names = variable.get_metadata().get("out_sharding")
  if isinstance(names, PartitionSpec):
    names = tuple(names)
  if names:
    if len(names) != len(shape):
      raise ConfigError(f"Sharding annotation {names} has {len(names)} axes, the array has"
                        f" shape {shape}.")
    return logical_to_spec(names, rules=rules, mesh=mesh, shape=shape)
  return heuristic_spec(shape, mesh=mesh, min_size=min_size)


def flat_shardings(state: nnx.State, *, mesh: Mesh, rules: Sequence[tuple[str, Any]],
                   min_size: int = DEFAULT_MIN_SHARD_SIZE) -> dict[str, NamedSharding]:
  """{flat key: NamedSharding} for every variable of `state`."""
  return {flat_state.flat_key(path): NamedSharding(mesh, variable_spec(var, mesh=mesh, rules=rules,
                                                            min_size=min_size))
          for path, var in nnx.to_flat_state(state)}


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) axis over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_divisor(mesh: Mesh) -> int:
  """The global batch must be a multiple of this."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Process-local numpy batch -> global arrays split over data x fsdp.

  Each process passes its own rows (the data pipeline shards by process); the
  global batch is their concatenation in process order.
  """
  out = {}
  for name, value in batch.items():
    value = np.asarray(value)
    sharding = batch_sharding(mesh, value.ndim)
    if jax.process_count() == 1:
      out[name] = jax.device_put(value, sharding)
    else:
      out[name] = jax.make_array_from_process_local_data(sharding, value)
  return out


def describe(shardings: Mapping[str, NamedSharding], shapes: Mapping[str, Sequence[int]]) -> str:
  """One line per array: name, shape, spec (logged at start-up)."""
  width = max((len(k) for k in shardings), default=0)
  return "\n".join(f"  {k:<{width}}  {tuple(shapes[k])!s:<18} {shardings[k].spec}"
                   for k in sorted(shardings))


def log_layout(shardings: Mapping[str, NamedSharding], shapes: Mapping[str, Sequence[int]],
               title: str) -> None:
  logging.info("%s:\n%s", title, describe(shardings, shapes))
