"""Building blocks the drafters share: init, RoPE frequencies, attention, MLP.

The target's own helpers (`rms_norm`, `attention`, `rope`) are reused; what is
here is what drafters need beyond them: attention of one query block over
several key sets with one joint softmax (cached context + the block itself).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.models import rope as rope_lib
from dloop_jax.models.config import TransformerConfig
from dloop_jax.models.transformer import dense

NEG_INF = float(np.finfo(np.float32).min)


def init_weight(rngs: nnx.Rngs, shape: tuple[int, ...], *, fan_in: int, dtype,
                scale: float = 1.0) -> jax.Array:
  """Normal(0, scale / sqrt(fan_in)): keeps activations O(1) through a matmul."""
  return nnx.initializers.normal(scale * fan_in ** -0.5)(rngs.params(), shape, dtype)


def inverse_frequencies(target_config: TransformerConfig, head_dim: int) -> np.ndarray:
  """The target's RoPE (theta, scaling) at the drafter's head dimension."""
  return rope_lib.inverse_frequencies(dataclasses.replace(target_config, head_dim=head_dim))


def drafter_inverse_frequencies(spec, target_config: TransformerConfig) -> np.ndarray:
  """A drafter's RoPE: its own (`spec.rope_theta`, `spec.rope_scaling`) when it has one,
  else the target's, at the drafter's head dimension."""
  if spec.rope_theta is None:
    return inverse_frequencies(target_config, spec.head_dim)
  return rope_lib.inverse_frequencies_of(head_dim=spec.head_dim, rope_theta=spec.rope_theta,
                                         rope_scaling=spec.rope_scaling)


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, dense=dense) -> jax.Array:
  """Llama MLP with fused gate/up: x [..., D] -> [..., D] (`dense` products; for matrices
  held out-major, `transformer.dense_out_major`)."""
  gate, up = jnp.split(dense(x, w_gate_up), 2, axis=-1)
  return dense(jax.nn.silu(gate) * up, w_down)


def block_attention(q: jax.Array, *, ctx_k: jax.Array, ctx_v: jax.Array, ctx_mask: jax.Array,
                    own_k: jax.Array, own_v: jax.Array) -> jax.Array:
  """Query blocks over shared context keys and their own private keys.

  Every block `a` of a row sees the row's context slots allowed by
  `ctx_mask[b, a]` and all of its own private keys (its block, and in
  loop-aware training its earlier stages' stand-in context); one softmax spans
  both sets.

  With 2 blocks, context slots 0..3, block 0 allowed slots < 2 and block 1
  slots < 4, and 2 private keys per block ('x' = visible):

      key:          ctx0 ctx1 ctx2 ctx3 | own0 own1
      block 0 q*    x    x    .    .    | x    x      (its own keys)
      block 1 q*    x    x    x    x    | x    x      (its own keys)

  Args:
    q: [B, A, Q, N, H] queries (A blocks of Q, N heads).
    ctx_k: [B, C, K, H] context keys (K kv heads, N = K * G).
    ctx_v: [B, C, K, H] context values.
    ctx_mask: [B, A, C] which context slots each block sees.
    own_k: [B, A, P, K, H] private keys of each block.
    own_v: [B, A, P, K, H] private values.

  Returns:
    [B, A, Q, N * H].
  """
  b, a, nq, n, h = q.shape
  kv = ctx_k.shape[2]
  q = q.reshape(b, a, nq, kv, n // kv, h)
  scale = h ** -0.5
  s_ctx = jnp.einsum("baqkgh,bckh->bakgqc", q, ctx_k).astype(jnp.float32) * scale
  s_ctx = jnp.where(ctx_mask[:, :, None, None, None, :], s_ctx, NEG_INF)
  s_own = jnp.einsum("baqkgh,bapkh->bakgqp", q, own_k).astype(jnp.float32) * scale
  probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_own], axis=-1), axis=-1)
  c = ctx_k.shape[1]
  p_ctx = probs[..., :c].astype(ctx_v.dtype)
  p_own = probs[..., c:].astype(own_v.dtype)
  out = (jnp.einsum("bakgqc,bckh->baqkgh", p_ctx, ctx_v)
         + jnp.einsum("bakgqp,bapkh->baqkgh", p_own, own_v))
  return out.reshape(b, a, nq, n * h)


def scatter_to_vocab(probs: jax.Array, d2t: jax.Array, vocab_size: int) -> jax.Array:
  """Draft-vocabulary probabilities [..., Vd] -> target vocabulary [..., V] (zeros elsewhere)."""
  full = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype)
  return full.at[..., d2t].set(probs)
