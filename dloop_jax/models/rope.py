"""Rotary position embeddings (HF `rotate_half` layout), with Llama-3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dloop_jax.models.config import TransformerConfig


def inverse_frequencies(config: TransformerConfig) -> np.ndarray:
  """[head_dim // 2] inverse frequencies, with Llama-3 scaling when configured."""
  dim = config.head_dim
  inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  rs = config.rope_scaling
  if rs is None:
    return inv.astype(np.float32)
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
      rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [B, T, head_dim] for integer positions [B, T]."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [B, T, N, H] by angles [B, T, H]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin
