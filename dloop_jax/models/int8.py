"""Int8 weight matrices: quantized once at load, multiplied in two forms.

A matrix is stored as int8 values and one f32 scale per output channel
(symmetric, per-output-channel): `w ≈ values * scale`, the scale of a channel
being its largest magnitude / 127. Both are explicit arrays of the model state,
so `nnx.split` / `nnx.merge`, jit and sharding treat them as any weight.

Products come in two forms, chosen while tracing (`models.cpu_kernels`):

    form                    activations               product
    XLA:CPU (`active()`)    quantized per row to      int8 x int8 -> int32 `dot_general`,
                            int8 on the fly           then x row scale x channel scale (f32)
    standard (GPU / TPU)    the compute dtype         weight-only: int8 -> compute dtype,
                                                      dot (f32 accumulation), x channel scale

Why two: XLA:CPU does not fuse a float conversion of the weights into its
matrix kernels for products of two or more rows, it writes the whole float
matrix first (more bytes than a 16-bit matrix), while an integer product reads
the int8 weights directly; GPU and TPU compilers fuse the conversion into the
matrix product, where keeping the activations in float costs nothing and
loses nothing. The integer form accumulates exactly in int32 and scales each
row by its own scale, so a row's result does not depend on the rows beside it;
it is always run with at least two rows (XLA:CPU's one-row integer product
converts the whole weight first). docs/decoding.md ("Weights") has the
measurements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dloop_jax.models import cpu_kernels as cpu_kernels_lib

DTYPE = jnp.int8
# Symmetric range: -127..127 (the code -128 is left unused, so negating a
# value never overflows and the scale maps both signs alike).
LEVELS = 127


def is_int8(dtype) -> bool:
  """Whether `dtype` is the int8 weight storage."""
  return jnp.dtype(dtype) == jnp.dtype(DTYPE)


def quantize(w: np.ndarray | jax.Array, *, axis: int) -> tuple[np.ndarray | jax.Array, ...]:
  """w [..., K, ...] -> (int8 values of w's shape, f32 scales without `axis`).

  `axis` is the contracted axis (K): every other index is an output channel
  with its own scale, largest |w| of the channel / 127. An all-zero channel
  gets scale 1 (its values are 0 either way). A host (numpy) matrix is
  quantized on the host, a JAX one (random initialisation) with JAX.
  """
  xp = np if isinstance(w, np.ndarray) else jnp
  w = xp.asarray(w, np.float32)
  peak = xp.max(xp.abs(w), axis=axis, keepdims=True)
  scale = xp.where(peak > 0, peak / LEVELS, 1.0).astype(np.float32)
  values = xp.clip(xp.rint(w / scale), -LEVELS, LEVELS).astype(np.int8)
  return values, xp.squeeze(scale, axis=axis)


def dequantize(values, scale, *, axis: int, dtype=np.float32) -> np.ndarray:
  """The float matrix int8 `values` and `scale` stand for (inverse of `quantize`)."""
  values = np.asarray(values, np.float32)
  return (values * np.expand_dims(np.asarray(scale, np.float32), axis)).astype(dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [R, K] float -> (int8 [R, K], f32 scale [R, 1]): symmetric, one scale per row.

  A row's codes depend on that row alone (an all-zero row gets scale 1).
  """
  x = x.astype(jnp.float32)
  peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scale = jnp.where(peak > 0, peak / LEVELS, 1.0)
  codes = jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS).astype(DTYPE)
  return codes, scale


def product(x: jax.Array, values: jax.Array, scale: jax.Array, *, contract: int) -> jax.Array:
  """x [..., K] times an int8 matrix along its axis `contract` -> f32 [..., N].

  `values` is [K, N] (contract 0) or [N, K] (contract 1) int8, `scale` [N]
  f32. The form follows `cpu_kernels.active()` (see the module docstring).
  """
  lead = x.shape[:-1]
  rows = int(np.prod(lead)) if lead else 1
  flat = x.reshape(rows, x.shape[-1])
  dims = (((1,), (contract,)), ((), ()))
  if cpu_kernels_lib.active():
    if rows == 1:
      # XLA:CPU's one-row integer product converts the whole weight matrix
      # first; two rows reach the kernel that reads int8 as it is.
      flat = jnp.concatenate([flat, jnp.zeros_like(flat)], axis=0)
    codes, row_scale = quantize_rows(flat)
    acc = jax.lax.dot_general(codes, values, dims, preferred_element_type=jnp.int32)
    out = acc[:rows].astype(jnp.float32) * (row_scale[:rows] * scale[None, :])
  else:
    # Weight-only: the conversion sits on the product's operand, where GPU and
    # TPU compilers fuse it into the matrix product.
    out = jax.lax.dot_general(flat, values.astype(flat.dtype), dims,
                              preferred_element_type=jnp.float32) * scale[None, :]
  return out.reshape(lead + (out.shape[-1],))


def take_rows(values: jax.Array, scale: jax.Array, ids: jax.Array, *, dtype) -> jax.Array:
  """Rows `ids` of an int8 table [V, D] with one scale per row [V] -> [..., D] in `dtype`."""
  rows = jnp.take(values, ids, axis=0).astype(jnp.float32)
  return (rows * jnp.take(scale, ids, axis=0)[..., None]).astype(dtype)
