"""The device mesh every part of the library places arrays on.

One mesh, three axes (MaxText naming):

    data    pure data parallelism: parameters replicated, batch split.
    fsdp    data parallelism with parameters (and optimizer state) split.
    tensor  tensor parallelism: the feature axes of matmuls split.

The trainer uses all three (`training.sharding`); inference uses data and
tensor with fsdp = 1 (`models.sharding`). Targets and drafters annotate their
weights with logical axis names; `DEFAULT_RULES` maps those names to mesh axes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import spmd as flax_spmd
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from dloop_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Names the drafters and targets annotate with.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("activation_batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", "tensor"),
    ("qkv", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("taps", None),
    ("seq", None),
    ("length", None),
    ("norm", None),
)


def make_mesh(mesh_config: Mapping[str, int], *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh.

  Args:
    mesh_config: axis name -> size; one axis may be -1 (all remaining devices).
      Axes left out have size 1.
    devices: devices to use (default: all of them, in `jax.devices()` order).

  Returns:
    A `Mesh` with Auto axes (GSPMD propagates shardings inside `jax.jit`).
  """
  unknown = sorted(set(mesh_config) - set(MESH_AXES))
  if unknown:
    raise ConfigError(f"Unknown mesh axes {unknown}; the mesh axes are {list(MESH_AXES)}.")
  devices = list(devices) if devices is not None else jax.devices()
  sizes = [int(mesh_config.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ConfigError(f"At most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}.")
  if any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"Mesh axis sizes must be positive (or one -1), got"
                      f" {dict(zip(MESH_AXES, sizes))}.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(f"{len(devices)} devices cannot fill mesh {dict(zip(MESH_AXES, sizes))}.")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(
        f"Mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, there are"
        f" {len(devices)}. Set one axis to -1 to use all devices.")
  if jax.process_count() > 1 and devices == jax.devices():
    # Hybrid layout: keeps data-parallel groups within hosts when possible.
    mesh_devices = mesh_utils.create_device_mesh(sizes, devices=devices)
  else:
    mesh_devices = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(mesh_devices, MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Iterator[None]:
  """Mesh + logical rules in scope: NNX variables annotated with `out_sharding`
  are created sharded (flax 0.12 shards them eagerly and needs both)."""
  with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(tuple(rules)):
    yield
