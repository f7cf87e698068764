"""Rotary position embeddings (HF `rotate_half` layout), with Llama-3 scaling.

A target rotates with its config's settings (`inverse_frequencies`); a drafter
may own others (`inverse_frequencies_of`: EAGLE-3 drafters of Llama-3.1 rotate
with theta 10000 and no scaling, whatever the target does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dloop_jax.errors import ConfigError
from dloop_jax.models.config import RopeScaling, TransformerConfig


def inverse_frequencies(config: TransformerConfig) -> np.ndarray:
  """[head_dim // 2] inverse frequencies of a target, with Llama-3 scaling when configured."""
  return inverse_frequencies_of(head_dim=config.head_dim, rope_theta=config.rope_theta,
                                rope_scaling=config.rope_scaling)


def inverse_frequencies_of(*, head_dim: int, rope_theta: float,
                           rope_scaling: RopeScaling | None) -> np.ndarray:
  """[head_dim // 2] inverse frequencies from explicit settings (a drafter's own RoPE)."""
  dim = head_dim
  inv = 1.0 / (rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  rs = rope_scaling
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


def scaling_from_dict(rs: Mapping[str, Any] | None) -> RopeScaling | None:
  """A config.json `rope_scaling` / `rope_parameters` dict -> `RopeScaling` (None: no scaling).

  Raises:
    ConfigError: a scaling type other than "llama3" (or "default").
  """
  if not rs:
    return None
  rope_type = rs.get("rope_type", rs.get("type"))
  if rope_type in (None, "default"):
    return None
  if rope_type != "llama3":
    raise ConfigError(f"Unsupported rope_scaling type {rope_type!r}; supported: 'llama3'.")
  try:
    return RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                       high_freq_factor=float(rs["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           rs["original_max_position_embeddings"]))
  except KeyError as e:
    raise ConfigError(f"rope_scaling of type 'llama3' lacks {e.args[0]!r}.") from e


def scaling_to_dict(rs: RopeScaling | None) -> dict[str, Any] | None:
  """`RopeScaling` -> the config.json `rope_scaling` dict (None: no scaling)."""
  if rs is None:
    return None
  return dict(rope_type="llama3", factor=rs.factor, low_freq_factor=rs.low_freq_factor,
              high_freq_factor=rs.high_freq_factor,
              original_max_position_embeddings=rs.original_max_position_embeddings)


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
