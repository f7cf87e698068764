"""Explicit KV cache: a pytree passed into and returned from every forward.

Slot `j` of a row holds the key/value of the token at position `j`. A row's
`lengths[b]` is how many slots are committed; slots at and past it are stale
and masked, then overwritten. Rolling back after a rejected draft is therefore
just `cache.replace(lengths=...)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Keys and values of all layers, one array per layer.

  Per-layer arrays (not one [L, ...] array) let each layer's update happen in
  place: slicing a layer out of a stacked cache copies it on CPU. On one
  device rows and kv heads share the leading axis (row b's K heads at
  b * K .. b * K + K - 1), the form attention's batched matmuls read without
  reshaping the cache. On a mesh they are two axes [B, K, C, H], so rows split
  over data and kv heads over tensor (`sharding.kv_spec`): each device holds
  its rows' heads and attends them itself (`sharding.per_shard`), through the
  same row-major [B * K, C, H] view of its slice.

  Attributes:
    k: L arrays [B * K, C, H] (on a mesh [B, K, C, H]) of keys (K kv heads,
      C slots, H head dim).
    v: L arrays of values, as `k`.
    lengths: [B] committed slots per row.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def capacity(self) -> int:
    return self.v[0].shape[-2]

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  def layer(self, index: int) -> tuple[jax.Array, jax.Array]:
    """Keys and values of one layer, both as [B, C, K, H]."""
    def unfold(x):
      x = x.reshape((self.batch_size, -1) + x.shape[-2:])  # [B, K, C, H]
      return jnp.transpose(x, (0, 2, 1, 3))
    return unfold(self.k[index]), unfold(self.v[index])

  @classmethod
  def create(cls, *, num_layers: int, batch_size: int, capacity: int,
             num_kv_heads: int, head_dim: int, dtype=jnp.float32,
             split_heads: bool = False) -> "KVCache":
    """Zeros; `split_heads`: rows and kv heads as two axes (for a mesh)."""
    rows = (batch_size, num_kv_heads) if split_heads else (batch_size * num_kv_heads,)
    shape = rows + (capacity, head_dim)
    return cls(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=lengths.astype(jnp.int32))

  def grow(self, capacity: int) -> "KVCache":
    """The same cache with `capacity` slots (new slots empty; one copy of the cache)."""
    if capacity < self.capacity:
      raise ValueError(f"grow() cannot shrink a cache of {self.capacity} slots to {capacity}.")
    def pad(x):
      return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, capacity - self.capacity), (0, 0)])
    return self.replace(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v)))

  def append(self, new_kv: Sequence[tuple[jax.Array, jax.Array]]) -> "KVCache":
    """Writes T new tokens' (keys, values) [B, T, K, H] per layer at slots
    `lengths + t` and advances `lengths` by T."""
    k, v = [], []
    for (k_cache, v_cache), (k_new, v_new) in zip(zip(self.k, self.v), new_kv):
      k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, self.lengths)
      k.append(k_cache)
      v.append(v_cache)
    t = new_kv[0][0].shape[1]
    return KVCache(k=tuple(k), v=tuple(v), lengths=self.lengths + t)


def write_rows(buffer: jax.Array, update: jax.Array, starts: jax.Array, *,
               axis: int = 1) -> jax.Array:
  """Writes `update[b]` into `buffer[b]` at slot `starts[b]` along `axis`.

  Args:
    buffer: [B, C, ...] (`axis` 1), or [B, ..., C, ...] with the slots at `axis`.
    update: `buffer`'s shape with T slots at `axis`.
    starts: [B] first slot written per row (callers keep `starts + T <= C`:
      `dynamic_update_slice` would otherwise clamp and overwrite valid slots).
    axis: the slot axis of `buffer`.
  """
  def one(buf, upd, start):
    index = (0,) * (axis - 1) + (start,) + (0,) * (buf.ndim - axis)
    return jax.lax.dynamic_update_slice(buf, upd.astype(buf.dtype), index)

  return jax.vmap(one)(buffer, update, starts)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             starts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Writes new keys / values [B, T, K, H] of one layer at slots `starts + t`.

  One update per cache array whatever the batch: a batched dynamic-update-slice
  (a scatter with the (row, kv head) axis as its batch axis) writes every row
  at its own start. Inside a decode loop XLA updates the carried cache in
  place through it, and on a mesh it splits along the cache's row / kv-head
  sharding like the cache itself. (Per-row updates made the program grow with
  the batch; tests/test_kv_cache_writes.py counts the updates in the compiled
  program.)

  Args:
    k_cache, v_cache: [B * K, C, H], or [B, K, C, H] (a mesh's layout).
    k, v: [B, T, K, H].
    starts: [B] (callers keep `starts + T <= C`).
  """
  b, t, kv_heads, h = k.shape
  split = k_cache.ndim == 4
  if not split:
    row_starts = jnp.repeat(starts, kv_heads, total_repeat_length=b * kv_heads)  # [B * K]

  def write(cache, new):
    new = jnp.transpose(new, (0, 2, 1, 3))  # [B, K, T, H]
    if split:
      # Rows and kv heads kept apart: the update splits along the mesh's rows and
      # heads like the cache (a [B * K] view of a split cache would gather it).
      return write_rows(cache, new, starts, axis=2)
    return write_rows(cache, new.reshape(b * kv_heads, t, h), row_starts)

  return write(k_cache, k), write(v_cache, v)


def committed_mask(*, starts: jax.Array, capacity: int) -> jax.Array:
  """[B, C] cache slots holding committed tokens (`j < starts[b]`)."""
  return jnp.arange(capacity)[None, :] < starts[:, None]


def attention_mask(*, starts: jax.Array, num_new: int, capacity: int,
                   block_mask: jax.Array | None = None) -> jax.Array:
  """Which cache slots each new token may attend to.

  New token `t` of row `b` sits in slot `starts[b] + t`. It sees every
  committed slot (`j < starts[b]`) and, among the new slots, those allowed by
  `block_mask[b, t, j - starts[b]]` (causal when `block_mask` is None).

  With starts = [2], num_new = 3, causal, capacity 6 ('x' = visible):

      slot:   0 1 2 3 4 5
      t = 0   x x x . . .
      t = 1   x x x x . .
      t = 2   x x x x x .

  Returns:
    [B, T, C] boolean mask.
  """
  slots = jnp.arange(capacity)[None, None, :]  # [1, 1, C]
  start = starts[:, None, None]  # [B, 1, 1]
  t = jnp.arange(num_new)[None, :, None]  # [1, T, 1]
  if block_mask is None:
    return slots <= start + t
  rel = slots - start  # [B, 1, C]
  in_block = (rel >= 0) & (rel < num_new)
  rel_clipped = jnp.clip(rel, 0, num_new - 1)
  rel_clipped = jnp.broadcast_to(rel_clipped, (starts.shape[0], num_new, capacity))
  allowed = jnp.take_along_axis(block_mask, rel_clipped, axis=2)
  return (slots < start) | (in_block & allowed)
