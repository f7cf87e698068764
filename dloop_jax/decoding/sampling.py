"""Logit processing and sampling, shared by the target and the drafters.

Speculative sampling is lossless only if the target distribution `p` and the
draft distribution `q` are processed the same way, so both go through
`processed_probs` with the same `SamplingConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from dloop_jax.errors import ConfigError


def _is_real(value) -> bool:
  """An int, float or numpy number; not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How next tokens are chosen.

  Attributes:
    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of tokens whose probability reaches top_p.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    t = self.temperature
    if not _is_real(t) or math.isnan(t) or t < 0 or math.isinf(t):
      raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}.")
    k = self.top_k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
      raise ConfigError(f"top_k must be an int >= 0 (0 = no limit), got {k!r}.")
    p = self.top_p
    if not _is_real(p) or math.isnan(p) or not 0.0 < p <= 1.0:
      raise ConfigError(f"top_p must be in (0, 1], got {p!r}.")
    # Plain Python numbers (numpy scalars are accepted): the config is part of
    # the key of compiled programs.
    object.__setattr__(self, "temperature", float(t))
    object.__setattr__(self, "top_k", int(k))
    object.__setattr__(self, "top_p", float(p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


GREEDY = SamplingConfig()


def processed_probs(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """Temperature, top-k and top-p applied to logits [..., V] -> probs [..., V] (f32)."""
  logits = logits.astype(jnp.float32)
  if config.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits / config.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if config.top_k and config.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  probs = jax.nn.softmax(logits, axis=-1)
  if config.top_p < 1.0:
    sorted_probs = -jnp.sort(-probs, axis=-1)
    # Keep a token while the mass strictly before it is below top_p; the most
    # likely token is always kept.
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < config.top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one token per row of probs [..., V] -> [...] int32."""
  logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def next_token(key: jax.Array, logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """Greedy argmax or a sample from the processed distribution; logits [..., V]."""
  if config.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sample_from_probs(key, processed_probs(logits, config))
