"""Where a target's weights, KV cache and batch rows live on a device mesh (inference).

The mesh is the trainer's (`dloop_jax.mesh.make_mesh`, axes data / fsdp /
tensor); inference uses two of its axes:

    data    batch rows split (each data shard decodes its own rows).
    tensor  the target's matrices split (Megatron style), and its KV heads.

Per decoder layer, with T = the tensor axis size:

    weight           split when T divides ...       otherwise, when T divides D
    wqkv  [D, Q+2KV] columns by kv-head group (K)   rows (hidden axis)
    bqkv  [Q+2KV]    by kv-head group (K)           replicated
    wo    [Q, D]     rows by head (K)               columns (hidden axis)
    w_gate_up [D,2F] columns by group (F)           rows (hidden axis)
    w_down [F, D]    rows (F)                       columns (hidden axis)
    embed [V, D]     rows (V)                       columns (D)
    lm_head [D, V]   columns (V)                    rows (D)
    norms            replicated

Head-parallel attention needs each tensor shard to hold whole heads of q, k
and v (and whole gate / up column pairs): the fused `wqkv` and `w_gate_up`
are stored "group-major" on a mesh (`interleave_columns`): shard t's columns
are its q heads, then its k heads, then its v heads. `Transformer.flat_params`
undoes it, so checkpoints and exports keep the standard layout.

The KV cache is [B, K, C, H] on a mesh: rows over data, kv heads over tensor
(with head-parallel attention; replicated over tensor otherwise), and each
layer's cache write and attention run under `jax.shard_map` (`per_shard`), so
a device attends its own rows' heads against its own cache slice and no
cache, query, key or value crosses devices. Elsewhere GSPMD (`jax.jit` over
arrays placed with these shardings) inserts the collectives (the all-reduces
of the head-split and MLP products); any placement gives the same result up
to the summation order of split contractions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dloop_jax import mesh as mesh_lib
from dloop_jax.errors import ConfigError
from dloop_jax.models.config import TransformerConfig

# Mesh axes inference uses (the trainer's fsdp axis must have size 1).
INFERENCE_AXES = ("data", "tensor")


def parse_mesh(text: str) -> dict[str, int]:
  """"data=2,tensor=4" -> {"data": 2, "tensor": 4}."""
  axes: dict[str, int] = {}
  for part in (p.strip() for p in str(text).split(",")):
    if not part:
      continue
    name, sep, value = part.partition("=")
    name = name.strip()
    if not sep or name not in INFERENCE_AXES:
      raise ConfigError(f"--mesh takes comma-separated AXIS=SIZE with AXIS in"
                        f" {list(INFERENCE_AXES)} (e.g. data=2,tensor=4); got {text!r}.")
    try:
      size = int(value)
    except ValueError:
      size = 0
    if size < 1 and size != -1:
      raise ConfigError(f"Mesh axis {name!r} needs a positive size (or -1: all remaining"
                        f" devices), got {value.strip()!r} in {text!r}.")
    if name in axes:
      raise ConfigError(f"Mesh axis {name!r} is given twice in {text!r}.")
    axes[name] = size
  if not axes:
    raise ConfigError(f"--mesh needs at least one AXIS=SIZE (e.g. data=2,tensor=4); got {text!r}.")
  return axes


def inference_mesh(axes: Mapping[str, int] | str, *,
                   devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The trainer's (data, fsdp, tensor) mesh with fsdp = 1.

  Args:
    axes: {"data": D, "tensor": T} (one may be -1: all remaining devices), or
      its "data=D,tensor=T" text. Axes left out have size 1.
    devices: default all of `jax.devices()`; D * T must equal their number.
  """
  if isinstance(axes, str):
    axes = parse_mesh(axes)
  unknown = sorted(set(axes) - set(INFERENCE_AXES))
  if unknown:
    raise ConfigError(f"Inference meshes have axes {list(INFERENCE_AXES)}; got {unknown}.")
  devices = list(devices) if devices is not None else jax.devices()
  sizes = {a: int(axes.get(a, 1)) for a in INFERENCE_AXES}
  known = int(np.prod([s for s in sizes.values() if s != -1]))
  if -1 not in sizes.values() and known != len(devices):
    raise ConfigError(
        f"Mesh {_text(sizes)} needs {known} devices, JAX has {len(devices)}"
        f" ({devices[0].platform}). Make data x tensor = {len(devices)} (or set one axis to -1);"
        " on a CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N"
        " set before JAX starts.")
  return mesh_lib.make_mesh(sizes, devices=devices)


def _text(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{a}={s}" for a, s in sizes.items())


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one target is split over one mesh.

  Attributes:
    mesh: the mesh.
    head_groups: column groups of `wqkv` / `bqkv` (the tensor size when it
      divides the kv heads: head-parallel attention; else 1).
    mlp_groups: column groups of `w_gate_up` (the tensor size when it divides
      the intermediate size; else 1).
  """

  mesh: Mesh
  head_groups: int
  mlp_groups: int

  @property
  def tensor(self) -> int:
    return self.mesh.shape["tensor"]

  @property
  def data(self) -> int:
    return self.mesh.shape["data"]


def layout(config: TransformerConfig, mesh: Mesh) -> Layout:
  """The split of `config`'s target over `mesh` (see the module docstring).

  Raises:
    ConfigError: the mesh has an fsdp axis, or the tensor size divides
      neither the kv heads nor the hidden size (nothing of a layer could be
      split).
  """
  if mesh.shape.get("fsdp", 1) != 1 or set(mesh.axis_names) - {"data", "fsdp", "tensor"}:
    raise ConfigError(f"Inference meshes have axes data and tensor (fsdp of size 1); got"
                      f" {dict(mesh.shape)}.")
  t = mesh.shape["tensor"]
  c = config
  heads = t if c.num_kv_heads % t == 0 else 1
  mlp = t if c.intermediate_size % t == 0 else 1
  if t > 1 and (heads == 1 or mlp == 1) and c.hidden_size % t:
    raise ConfigError(
        f"tensor={t} divides neither the {c.num_kv_heads} kv heads (or the intermediate size"
        f" {c.intermediate_size}) nor the hidden size {c.hidden_size} of"
        f" {c.name or 'the target'}: its layers cannot be split that way. Use a tensor size"
        f" that divides {c.num_kv_heads} (kv heads) or {c.hidden_size}.")
  return Layout(mesh=mesh, head_groups=heads, mlp_groups=mlp)


def param_spec(name: str, config: TransformerConfig, lay: Layout) -> PartitionSpec:
  """PartitionSpec of parameter `name` (`transformer.param_shapes` names; a
  layer's weight without the layer axis)."""
  t = lay.tensor
  if t == 1:
    return PartitionSpec()
  c = config
  hidden = "tensor" if c.hidden_size % t == 0 else None
  vocab = "tensor" if c.vocab_size % t == 0 else None
  heads, mlp = lay.head_groups > 1, lay.mlp_groups > 1
  specs = {
      "embed": PartitionSpec(vocab, None if vocab else hidden),
      "lm_head": PartitionSpec(None if vocab else hidden, vocab),
      "layers.wqkv": PartitionSpec(None, "tensor") if heads else PartitionSpec(hidden, None),
      "layers.bqkv": PartitionSpec("tensor") if heads else PartitionSpec(None),
      "layers.wo": PartitionSpec("tensor", None) if heads else PartitionSpec(None, hidden),
      "layers.w_gate_up": (PartitionSpec(None, "tensor") if mlp
                           else PartitionSpec(hidden, None)),
      "layers.w_down": PartitionSpec("tensor", None) if mlp else PartitionSpec(None, hidden),
  }
  return specs.get(name, PartitionSpec())


def kv_spec(lay: Layout) -> PartitionSpec:
  """PartitionSpec of one layer's cache keys / values on a mesh, [B, K, C, H]: rows over
  data, kv heads over tensor (when the heads are split)."""
  return PartitionSpec("data", _heads(lay), None, None)


def _heads(lay: Layout) -> str | None:
  """The mesh axis attention heads are split over (None: not split)."""
  return "tensor" if lay.head_groups > 1 else None


def per_shard(attend: Callable[..., tuple[jax.Array, jax.Array, jax.Array]], *,
              layout: Layout) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
  """`attend` run on each device over its own rows and kv heads (`jax.shard_map`).

  `attend(q, k, v, k_cache, v_cache, starts, masks, block_mask) -> (out,
  k_cache, v_cache)` writes one layer's new keys / values and attends; every
  argument but the caches leads with the batch axis: q [B, T, N, H]; k, v
  [B, T, K, H]; caches [B, K, C, H] (`kv_spec`); starts [B]; masks (a tuple or
  None) and block_mask (or None) [B, ...]; out [B, T, N * H]. Each device
  receives the rows of its data shard and, with head-parallel attention, the
  q / kv heads of its tensor shard (the column groups of `wqkv` keep a
  shard's q heads with their kv heads): everything its attention needs, so
  the cache never moves. Otherwise (tensor does not divide the kv heads) the
  heads are whole on every tensor shard, which compute the same attention.
  """
  heads = _heads(layout)
  rows = PartitionSpec("data")
  per_head = PartitionSpec("data", None, heads, None)  # [B, T, N or K, H]
  cache = kv_spec(layout)
  mapped = jax.shard_map(attend, mesh=layout.mesh,
                         in_specs=(per_head, per_head, per_head, cache, cache, rows, rows, rows),
                         out_specs=(PartitionSpec("data", None, heads), cache, cache))

  def run(*args):
    # The target's mesh, also inside another mesh's context (the trainer's, around an
    # online target's forward), where shard_map would refuse a mesh other than the context's.
    with jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):
      return mapped(*args)

  return run


def place(value: np.ndarray, spec: PartitionSpec, mesh: Mesh) -> jax.Array:
  """A host array onto `mesh`: each device receives only its own shard."""
  return jax.device_put(value, NamedSharding(mesh, spec))


def batch_spec(ndim: int) -> PartitionSpec:
  """Rows (axis 0) over data, the rest replicated."""
  return PartitionSpec("data", *([None] * (ndim - 1)))


def check_batch(batch_size: int, mesh: Mesh) -> None:
  """Batch rows are split over data: the batch must be a multiple of its size."""
  d = mesh.shape["data"]
  if batch_size % d:
    raise ConfigError(
        f"A batch of {batch_size} prompts cannot be split over the mesh's data axis of size {d}:"
        f" pass a multiple of {d} prompts (repeat one to pad), or use a mesh with data=1.")


def interleave_columns(w: np.ndarray, sizes: Sequence[int], groups: int) -> np.ndarray:
  """Fused column blocks -> group-major: [block_0 part_g, block_1 part_g, ...] for each g.

  With blocks q (4 columns) and k (2 columns) and 2 groups:
  [q0 q1 q2 q3 | k0 k1] -> [q0 q1 k0 | q2 q3 k1].

  Args:
    w: [..., sum(sizes)].
    sizes: the fused blocks' widths (each a multiple of `groups`).
    groups: the column groups (the tensor size).
  """
  if groups == 1:
    return w
  lead = w.shape[:-1]
  blocks = np.split(w, np.cumsum(sizes)[:-1], axis=-1)
  parts = [b.reshape(lead + (groups, s // groups)) for b, s in zip(blocks, sizes)]
  return np.concatenate(parts, axis=-1).reshape(lead + (-1,))


def deinterleave_columns(w: np.ndarray, sizes: Sequence[int], groups: int) -> np.ndarray:
  """Inverse of `interleave_columns`."""
  if groups == 1:
    return w
  lead = w.shape[:-1]
  grouped = w.reshape(lead + (groups, -1))
  parts = np.split(grouped, np.cumsum([s // groups for s in sizes])[:-1], axis=-1)
  return np.concatenate([p.reshape(lead + (-1,)) for p in parts], axis=-1)


def fused_blocks(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """Fused parameters -> widths of their column blocks (q, k, v; gate, up)."""
  c = config
  qkv = (c.q_size, c.kv_size, c.kv_size)
  return {"layers.wqkv": qkv, "layers.bqkv": qkv,
          "layers.w_gate_up": (c.intermediate_size, c.intermediate_size)}


def groups_of(name: str, lay: Layout) -> int:
  """Column groups of fused parameter `name` on this layout."""
  return lay.mlp_groups if name == "layers.w_gate_up" else lay.head_groups


def describe(config: TransformerConfig, lay: Layout) -> str:
  """One line: how the target is split (printed by `python -m infer --mesh`)."""
  c, t, d = config, lay.tensor, lay.data
  parts = [f"mesh data={d},tensor={t}: batch rows over data"]
  if t > 1:
    parts.append(f"attention by kv head ({c.num_kv_heads // t} of {c.num_kv_heads} per shard)"
                 if lay.head_groups > 1 else
                 f"attention on the hidden axis (tensor={t} does not divide the"
                 f" {c.num_kv_heads} kv heads)")
    parts.append("MLP by intermediate column" if lay.mlp_groups > 1 else
                 "MLP on the hidden axis")
    parts.append("KV cache over data x tensor" if lay.head_groups > 1 else
                 "KV cache over data only")
  return "; ".join(parts)


def replicate(tree, mesh: Mesh):
  """Every array of `tree` onto all of `mesh`'s devices (arrays already there kept)."""
  whole = NamedSharding(mesh, PartitionSpec())
  devices = set(mesh.devices.flat)

  def put(x):
    if isinstance(x, jax.Array) and set(x.sharding.device_set) == devices:
      return x
    return jax.device_put(x, whole)

  return jax.tree.map(put, tree)
