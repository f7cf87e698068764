"""Decoder-only target transformer (Llama family, Qwen2, Qwen3) in Flax NNX.

Each decoder layer owns its weights (`DecoderLayer`) and the forward loops over
the layers in Python. A `lax.scan` over weights stacked on a layer axis would
compile one layer body instead of L, but on CPU XLA then copies each layer's
weights out of the stack (a `dynamic-slice`) before every matmul, which nearly
doubles the memory traffic of a batch-1 decode step. q/k/v and gate/up
projections are fused into single matmuls.

Loaders and `flat_params` speak the stacked layout below (one array per weight
kind, layers on axis 0); `from_params` splits it into the layers.

    embed                [V, D]
    layers.attn_norm     [L, D]
    layers.wqkv          [L, D, Q + 2 KV]   columns: q heads, k heads, v heads
    layers.bqkv          [L, Q + 2 KV]      (qwen2 / attention_bias only)
    layers.q_norm        [L, H]             (qwen3 only)
    layers.k_norm        [L, H]             (qwen3 only)
    layers.wo            [L, Q, D]
    layers.mlp_norm      [L, D]
    layers.w_gate_up     [L, D, 2 F]        columns: gate, then up
    layers.w_down        [L, F, D]
    final_norm           [D]
    lm_head              [D, V]             (untied embeddings only)

with Q = heads * head_dim, KV = kv_heads * head_dim, and q/k columns in the
Hugging Face (`rotate_half`) RoPE layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax.errors import ModelLoadError
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import rope as rope_lib
from dloop_jax.models.config import TransformerConfig


def param_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """Name -> shape of every parameter this config needs."""
  c = config
  d, l = c.hidden_size, c.num_layers
  shapes = {
      "embed": (c.vocab_size, d),
      "layers.attn_norm": (l, d),
      "layers.wqkv": (l, d, c.q_size + 2 * c.kv_size),
      "layers.wo": (l, c.q_size, d),
      "layers.mlp_norm": (l, d),
      "layers.w_gate_up": (l, d, 2 * c.intermediate_size),
      "layers.w_down": (l, c.intermediate_size, d),
      "final_norm": (d,),
  }
  if c.attention_bias:
    shapes["layers.bqkv"] = (l, c.q_size + 2 * c.kv_size)
  if c.qk_norm:
    shapes["layers.q_norm"] = (l, c.head_dim)
    shapes["layers.k_norm"] = (l, c.head_dim)
  if not c.tie_embeddings:
    shapes["lm_head"] = (d, c.vocab_size)
  return shapes


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in f32, as the reference implementation does."""
  dtype = x.dtype
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(dtype) * x32.astype(dtype)


@struct.dataclass
class ForwardOutput:
  """What one target forward returns.

  Attributes:
    logits: [B, N, V] f32 logits at the requested positions (N = T unless
      `logit_positions` was given).
    cache: the cache with the T new tokens written at `lengths + t` and
      `lengths` advanced by T (callers roll back rejected tokens).
    taps: [B, T, n_taps, D] outputs of the tapped decoder layers.
    hidden: [B, T, D] final hidden states (after the final norm).
  """

  logits: jax.Array
  cache: kv_lib.KVCache
  taps: jax.Array
  hidden: jax.Array


LAYER_WEIGHTS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm",
                 "w_gate_up", "w_down")


def random_layer_weights(config: TransformerConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                         init_std: float = 0.02) -> dict[str, jax.Array]:
  """Random weights of all layers, stacked on axis 0 (the `param_shapes` layout).

  Drawn stacked, one key per weight kind, so a seed gives the same target
  whatever the in-memory layout of the layers.
  """
  c = config
  l, d = c.num_layers, c.hidden_size
  init = nnx.initializers.normal(init_std)
  weights = {"attn_norm": jnp.ones((l, d), dtype),
             "wqkv": init(rngs.params(), (l, d, c.q_size + 2 * c.kv_size), dtype)}
  if c.attention_bias:
    weights["bqkv"] = init(rngs.params(), (l, c.q_size + 2 * c.kv_size), dtype)
  if c.qk_norm:
    weights["q_norm"] = jnp.ones((l, c.head_dim), dtype)
    weights["k_norm"] = jnp.ones((l, c.head_dim), dtype)
  weights["wo"] = init(rngs.params(), (l, c.q_size, d), dtype)
  weights["mlp_norm"] = jnp.ones((l, d), dtype)
  weights["w_gate_up"] = init(rngs.params(), (l, d, 2 * c.intermediate_size), dtype)
  weights["w_down"] = init(rngs.params(), (l, c.intermediate_size, d), dtype)
  return weights


class DecoderLayer(nnx.Module):
  """One pre-norm decoder layer: attention over the KV cache, then a SwiGLU MLP.

  Weights (names as in `param_shapes`, without the layer axis): attn_norm [D],
  wqkv [D, Q + 2 KV], optional bqkv [Q + 2 KV], optional q_norm / k_norm [H],
  wo [Q, D], mlp_norm [D], w_gate_up [D, 2 F], w_down [F, D].
  """

  def __init__(self, weights: Mapping[str, jax.Array]):
    for name in LAYER_WEIGHTS:
      setattr(self, name, nnx.Param(weights[name]) if name in weights else None)

  def weights(self) -> dict[str, jax.Array]:
    return {n: getattr(self, n)[...] for n in LAYER_WEIGHTS if getattr(self, n) is not None}

  def __call__(self, h: jax.Array, *, config: TransformerConfig, cos: jax.Array,
               sin: jax.Array, mask: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               starts: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> (h [B, T, D], k_cache, v_cache with the T new slots written).

    `k_cache` and `v_cache` [B * K, C, H] are this layer's `KVCache` arrays.
    """
    c = config
    b, t, _ = h.shape
    eps = c.rms_norm_eps
    x = rms_norm(h, self.attn_norm[...], eps)
    qkv = x @ self.wqkv[...]
    if self.bqkv is not None:
      qkv = qkv + self.bqkv[...]
    q = qkv[..., :c.q_size].reshape(b, t, c.num_heads, c.head_dim)
    k = qkv[..., c.q_size:c.q_size + c.kv_size].reshape(b, t, c.num_kv_heads, c.head_dim)
    v = qkv[..., c.q_size + c.kv_size:].reshape(b, t, c.num_kv_heads, c.head_dim)
    if self.q_norm is not None:
      q = rms_norm(q, self.q_norm[...], eps)
      k = rms_norm(k, self.k_norm[...], eps)
    q = rope_lib.apply_rope(q, cos, sin)
    k = rope_lib.apply_rope(k, cos, sin)
    k_cache, v_cache = kv_lib.write_kv(k_cache, v_cache, k, v, starts)
    h = h + cached_attention(q, k_cache, v_cache, mask) @ self.wo[...]
    x = rms_norm(h, self.mlp_norm[...], eps)
    gate, up = jnp.split(x @ self.w_gate_up[...], 2, axis=-1)
    h = h + (jax.nn.silu(gate) * up) @ self.w_down[...]
    return h, k_cache, v_cache


def project_rows(hidden: jax.Array, rows: jax.Array) -> jax.Array:
  """hidden [..., D] @ rows[V, D].T -> f32 [..., V], without transposing `rows`.

  Tied heads read the embedding [V, D] as is: `embed.T` would make XLA copy the
  whole matrix (113 MB for SmolLM2) in every forward on CPU.
  """
  out = jax.lax.dot_general(hidden, rows, (((hidden.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return out.astype(jnp.float32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention of new queries over all cache slots.

  Args:
    q: [B, T, N, H] queries (N query heads).
    k: [B, C, K, H] keys of every slot (K kv heads, N = K * G).
    v: [B, C, K, H] values.
    mask: [B, T, C] visibility.

  Returns:
    [B, T, N * H].
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)
  scores = jnp.einsum("btkgh,bckh->bkgtc", q, k).astype(jnp.float32) * (h ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgtc,bckh->btkgh", probs, v)
  return out.reshape(b, t, n * h)


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     mask: jax.Array) -> jax.Array:
  """`attention` over one layer of the target's `KVCache`, read in its layout.

  Args:
    q: [B, T, N, H] queries.
    k_cache: [B * K, C, H] keys (row b's kv heads at b * K .. b * K + K - 1).
    v_cache: [B * K, C, H] values.
    mask: [B, T, C] visibility.

  Returns:
    [B, T, N * H].
  """
  b, t, n, h = q.shape
  kv_heads = k_cache.shape[0] // b
  g = n // kv_heads
  # Queries grouped per (row, kv head): [B * K, G * T, H].
  q = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b * kv_heads, g * t, h)
  # The cache is the left operand of both matmuls, already in the
  # [batch, rows, inner] form XLA:CPU multiplies without reshaping or copying
  # it (a reshaped cache operand made XLA duplicate the row write and copy the
  # whole layer cache several times per step); only q and probs move.
  scores = jnp.einsum("nch,nqh->nqc", k_cache, q).astype(jnp.float32) * (h ** -0.5)
  scores = scores.reshape(b, kv_heads, g, t, -1)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
  probs = probs.reshape(b * kv_heads, g * t, -1)
  out = jnp.einsum("nch,nqc->nqh", v_cache, probs)  # [B * K, G * T, H]
  out = out.reshape(b, kv_heads, g, t, h).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, n * h)


def _split_layers(stacked: Mapping[str, jax.Array | np.ndarray], num_layers: int) -> nnx.List:
  return nnx.List([DecoderLayer({name: jnp.asarray(w[i]) for name, w in stacked.items()})
                   for i in range(num_layers)])


class Transformer(nnx.Module):
  """Decoder-only LM whose forward takes and returns an explicit KV cache."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs | None = None,
               dtype=jnp.float32, init_std: float = 0.02):
    """Random initialisation (loaders use `from_params`).

    `init_std` above the usual 0.02 gives tiny test targets peaked,
    non-uniform next-token distributions, so drafters have something to learn.
    """
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = config
    self.dtype = dtype
    c = config
    init = nnx.initializers.normal(init_std)
    self.embed = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
    stacked = random_layer_weights(c, rngs=rngs, dtype=dtype, init_std=init_std)
    self.layers = _split_layers(stacked, c.num_layers)
    self.final_norm = nnx.Param(jnp.ones((c.hidden_size,), dtype))
    self.lm_head = (None if c.tie_embeddings else nnx.Param(
        init(rngs.params(), (c.hidden_size, c.vocab_size), dtype)))

  # ----------------------------------------------------------------- weights
  @classmethod
  def from_params(cls, config: TransformerConfig, params: Mapping[str, np.ndarray], *,
                  dtype=jnp.float32, source: str = "") -> "Transformer":
    """Builds a model from a flat `{name: array}` dict in `param_shapes` layout."""
    expected = param_shapes(config)
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    if missing or unexpected:
      raise ModelLoadError(
          f"Weights{' from ' + source if source else ''} do not match the config:"
          f" missing {missing}, unexpected {unexpected}.")
    for name, shape in expected.items():
      if tuple(params[name].shape) != shape:
        raise ModelLoadError(
            f"Weight {name!r}{' in ' + source if source else ''} has shape"
            f" {tuple(params[name].shape)}, the config needs {shape}.")
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype))
    model.embed = nnx.Param(jnp.asarray(params["embed"], dtype))
    model.final_norm = nnx.Param(jnp.asarray(params["final_norm"], dtype))
    if "lm_head" in params:
      model.lm_head = nnx.Param(jnp.asarray(params["lm_head"], dtype))
    stacked = {name.split(".", 1)[1]: np.asarray(value, dtype)
               for name, value in params.items() if name.startswith("layers.")}
    model.layers = _split_layers(stacked, config.num_layers)
    return model

  def flat_params(self) -> dict[str, np.ndarray]:
    """Inverse of `from_params`."""
    out = {"embed": np.asarray(self.embed[...]), "final_norm": np.asarray(self.final_norm[...])}
    if self.lm_head is not None:
      out["lm_head"] = np.asarray(self.lm_head[...])
    for name in self.layers[0].weights():
      out[f"layers.{name}"] = np.stack([np.asarray(l.weights()[name]) for l in self.layers])
    return out

  def init_cache(self, *, batch_size: int, capacity: int) -> kv_lib.KVCache:
    c = self.config
    return kv_lib.KVCache.create(
        num_layers=c.num_layers, batch_size=batch_size, capacity=capacity,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype)

  # ----------------------------------------------------------------- forward
  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens, axis=0)

  def unembed(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> f32 logits [..., V]."""
    if self.lm_head is None:
      return project_rows(hidden, self.embed[...])
    return jnp.dot(hidden, self.lm_head[...],
                   preferred_element_type=jnp.float32).astype(jnp.float32)

  def __call__(
      self,
      tokens: jax.Array,
      *,
      positions: jax.Array,
      cache: kv_lib.KVCache,
      block_mask: jax.Array | None = None,
      taps: Sequence[int] = (),
      logit_positions: jax.Array | None = None,
  ) -> ForwardOutput:
    """Runs T new tokens per row against the cache.

    Args:
      tokens: [B, T] token ids.
      positions: [B, T] RoPE positions (usually `cache.lengths[:, None] + t`;
        tree verification passes depths instead).
      cache: KV cache; new tokens go to slots `cache.lengths[b] + t`.
      block_mask: optional [B, T, T] mask among the new tokens (default causal).
      taps: decoder-layer indices whose outputs are returned in `taps`.
      logit_positions: optional [B, N] indices into T: compute logits there only.

    Returns:
      A `ForwardOutput`.
    """
    c = self.config
    b, t = tokens.shape
    starts = cache.lengths
    mask = kv_lib.attention_mask(starts=starts, num_new=t, capacity=cache.capacity,
                                 block_mask=block_mask)
    cos, sin = rope_lib.rope_angles(positions, rope_lib.inverse_frequencies(c))
    h = self.embed_tokens(tokens).astype(self.dtype)
    num_layers = len(self.layers)
    wanted = {i % num_layers for i in taps}
    k_new, v_new, layer_outputs = [], [], {}
    for i, layer in enumerate(self.layers):
      h, k_layer, v_layer = layer(h, config=c, cos=cos, sin=sin, mask=mask,
                                  k_cache=cache.k[i], v_cache=cache.v[i], starts=starts)
      k_new.append(k_layer)
      v_new.append(v_layer)
      if i in wanted:
        layer_outputs[i] = h
    if taps:
      tapped = jnp.stack([layer_outputs[i % num_layers] for i in taps], axis=2)  # [B, T, n, D]
    else:
      tapped = jnp.zeros((b, t, 0, c.hidden_size), h.dtype)
    hidden = rms_norm(h, self.final_norm[...], c.rms_norm_eps)
    if logit_positions is not None:
      selected = jnp.take_along_axis(hidden, logit_positions[..., None], axis=1)
    else:
      selected = hidden
    logits = self.unembed(selected)
    new_cache = kv_lib.KVCache(k=tuple(k_new), v=tuple(v_new), lengths=starts + t)
    return ForwardOutput(logits=logits, cache=new_cache, taps=tapped, hidden=hidden)
