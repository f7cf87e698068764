"""Acceptance rules of speculative decoding (unchanged by DLoop).

Verification reads `[last committed token, d_1, ..., d_m]` in one target
forward. Position t of that forward predicts the token after d_t (d_0 = the
last committed token), so draft d_{t+1} is checked against position t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib


@struct.dataclass
class Acceptance:
  """Outcome of verifying one block of drafts per row.

  Attributes:
    num_accepted: [B] drafts accepted (k).
    new_tokens: [B, m + 1] committed tokens: d_1..d_k, then the bonus token at
      index k; entries past k are padding.
  """

  num_accepted: jax.Array
  new_tokens: jax.Array


def _prefix_length(ok: jax.Array) -> jax.Array:
  """Length of the leading run of True in ok [B, m] -> [B]."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


def _assemble(drafts: jax.Array, k: jax.Array, bonus: jax.Array) -> jax.Array:
  """[d_1..d_k, bonus, pad...] of width m + 1."""
  b, m = drafts.shape
  padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
  t = jnp.arange(m + 1)[None, :]
  return jnp.where(t == k[:, None], bonus[:, None], padded).astype(jnp.int32)


def accept_greedy(*, logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> Acceptance:
  """Longest prefix of drafts equal to the target argmax, then its own token.

  Args:
    logits: [B, m + 1, V] target logits of the verify forward.
    drafts: [B, m] drafted tokens.
    num_drafts: [B] how many of the m drafts each row really drafted.
  """
  m = drafts.shape[1]
  target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, m + 1]
  ok = (drafts == target[:, :m]) & (jnp.arange(m)[None, :] < num_drafts[:, None])
  k = _prefix_length(ok)
  bonus = jnp.take_along_axis(target, k[:, None], axis=1)[:, 0]
  return Acceptance(num_accepted=k, new_tokens=_assemble(drafts, k, bonus))


def accept_sampling(*, key: jax.Array, logits: jax.Array, drafts: jax.Array,
                    draft_probs: jax.Array, num_drafts: jax.Array,
                    config: sampling_lib.SamplingConfig) -> Acceptance:
  """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

  Accept d_t with probability min(1, p(d_t) / q(d_t)); at the first rejection
  sample from norm(max(p - q, 0)); if every draft is accepted, sample the bonus
  from p. p and q are processed with the same `config`.

  Args:
    key: PRNG key.
    logits: [B, m + 1, V] target logits.
    drafts: [B, m] drafted tokens, drawn from draft_probs.
    draft_probs: [B, m, V] processed draft distributions.
    num_drafts: [B] valid drafts per row.
    config: sampling configuration (temperature > 0).
  """
  m = drafts.shape[1]
  accept_key, bonus_key = jax.random.split(key)
  p = sampling_lib.processed_probs(logits, config)  # [B, m + 1, V]
  p_draft = jnp.take_along_axis(p[:, :m], drafts[..., None], axis=-1)[..., 0]
  q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(accept_key, drafts.shape, jnp.float32)
  ok = (u * q_draft < p_draft) & (jnp.arange(m)[None, :] < num_drafts[:, None])
  k = _prefix_length(ok)
  p_k = jnp.take_along_axis(p, k[:, None, None], axis=1)[:, 0]  # [B, V]
  q_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
  q_k = jnp.take_along_axis(q_padded, k[:, None, None], axis=1)[:, 0]
  rejected = k < num_drafts
  residual = jnp.maximum(p_k - q_k, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  # p == q gives zero residual mass but then rejection has probability 0.
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_k)
  bonus_probs = jnp.where(rejected[:, None], residual, p_k)
  bonus = sampling_lib.sample_from_probs(bonus_key, bonus_probs)
  return Acceptance(num_accepted=k, new_tokens=_assemble(drafts, k, bonus))


def pad_axis1(x: jax.Array, width: int) -> jax.Array:
  """x [B, T, ...] padded with zeros to [B, width, ...]."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, width - x.shape[1])
  return jnp.pad(x, pad)


def at_width(forward: Callable[[int], tuple[Any, Any]], *, branch: jax.Array,
             widths: Sequence[int], pad_to: int) -> tuple[Any, Any, jax.Array]:
  """The verification forward at the width `widths[branch]`, a traced choice.

  A `lax.switch` over the compiled widths (none with one width). A branch's
  outputs of width w are padded on axis 1 to `pad_to`, so that every branch
  returns one shape:

      widths (1, 4, 7), branch 1, pad_to 7:  forward(4) -> tokens [B, 4] -> [B, 7]

  A branch should only read a cache: one that wrote it would return a whole
  copy of it. Chains with one width write theirs in place (`as_is`).

  Args:
    forward: width -> (outputs to pad: arrays [B, width, ...], outputs as they are).
    branch: scalar int32 index into `widths`.
    widths: the compiled widths (static).
    pad_to: the padded width, at least max(widths).

  Returns:
    (the padded outputs, the others, the scalar width that ran).
  """

  def run(width: int):
    def branch_fn():
      padded, as_is = forward(width)
      return (jax.tree.map(lambda x: pad_axis1(x, pad_to), padded), as_is,
              jnp.asarray(width, jnp.int32))

    return branch_fn

  if len(widths) == 1:
    return run(widths[0])()
  return jax.lax.switch(branch, [run(w) for w in widths])
