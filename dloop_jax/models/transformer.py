"""Decoder-only target transformer (Llama family, Qwen2, Qwen3) in Flax NNX.

Each decoder layer owns its weights (`DecoderLayer`) and the forward loops over
the layers in Python. A `lax.scan` over weights stacked on a layer axis would
compile one layer body instead of L, but on CPU XLA then copies each layer's
weights out of the stack (a `dynamic-slice`) before every matmul, which nearly
doubles the memory traffic of a batch-1 decode step. q/k/v and gate/up
projections are fused into single matmuls.

Loaders and `flat_params` speak the stacked layout below (one array per weight
kind, layers on axis 0); `from_params` splits it into the layers. In memory,
16-bit layer matrices are held out-major, transposed to [N, K] (see
`LAYER_MATRICES`); the layout below is the one every file and loader sees.

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

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax.errors import ModelLoadError
from dloop_jax.models import attention as attention_lib
from dloop_jax.models import attention_kernels as attention_kernels_lib
from dloop_jax.models import cpu_kernels as cpu_kernels_lib
from dloop_jax.models import int8 as int8_lib
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import rope as rope_lib
from dloop_jax.models import sharding as sharding_lib
from dloop_jax.models.attention import attention  # noqa: F401 (re-exported: drafters use it)
from dloop_jax.models.config import TransformerConfig, tiny_config


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
      `lengths` advanced by T (callers roll back rejected tokens); the cache as
      it came with `write_cache=False`.
    taps: [B, T, n_taps, D] outputs of the tapped decoder layers.
    hidden: [B, T, D] final hidden states (after the final norm).
    new_kv: per layer, the (keys, values) [B, T, K, H] of the T new tokens.
  """

  logits: jax.Array
  cache: kv_lib.KVCache
  taps: jax.Array
  hidden: jax.Array
  new_kv: tuple[tuple[jax.Array, jax.Array], ...]


# The matrices that `weight_dtype` applies to (norms and biases stay in `dtype`).
MATRIX_WEIGHTS = ("embed", "lm_head", "layers.wqkv", "layers.wo", "layers.w_gate_up",
                  "layers.w_down")
# Int8 matrices carry one f32 scale per output channel in a parameter of this
# suffix (`models.int8`): "layers.wqkv" [L, K, N] -> "layers.wqkv_scale" [L, N],
# "embed" [V, D] -> "embed_scale" [V], "lm_head" [D, V] -> "lm_head_scale" [V].
SCALE_SUFFIX = "_scale"
# The axis each matrix contracts (its other axes are output channels).
_CONTRACTED_AXIS = {"embed": 1, "lm_head": 0, "layers.wqkv": 1, "layers.wo": 1,
                    "layers.w_gate_up": 1, "layers.w_down": 1}
# A layer's matrices [K, N]. Stored in 16 bits, a layer holds them out-major,
# transposed to [N, K], and multiplies them with the matrix on the left (see
# `_product`): XLA:CPU streams them so at memory speed for one to a few hundred
# rows, where stored [K, N] a product of a few rows leaves its fast kernels,
# and a row of the product gets the same bits whatever the number of rows
# beside it (the attention's f32 products do not: a fixed forward width,
# `generate(fixed_width=)`, is what makes widths agree exactly; docs/design.md
# §Choices for XLA:CPU).
LAYER_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
_STACKED_LAYER_MATRICES = tuple(f"layers.{name}" for name in LAYER_MATRICES)
LAYER_WEIGHTS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "mlp_norm",
                 "w_gate_up", "w_down") + tuple(m + SCALE_SUFFIX for m in LAYER_MATRICES)


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
  wo [Q, D], mlp_norm [D], w_gate_up [D, 2 F], w_down [F, D]; with
  `out_major` the four matrices are held transposed (wqkv [Q + 2 KV, D], ...);
  int8 matrices come with their scales (wqkv_scale [Q + 2 KV], ...).
  """

  def __init__(self, weights: Mapping[str, jax.Array], *, out_major: bool = False):
    for name in LAYER_WEIGHTS:
      setattr(self, name, nnx.Param(weights[name]) if name in weights else None)
    self.out_major = out_major

  def weights(self) -> dict[str, jax.Array]:
    return {n: getattr(self, n)[...] for n in LAYER_WEIGHTS if getattr(self, n) is not None}

  def __call__(self, h: jax.Array, *, config: TransformerConfig, cos: jax.Array,
               sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array, starts: jax.Array,
               masks: tuple[jax.Array, ...] | None, block_mask: jax.Array | None,
               write_cache: bool, groups: tuple[int, int] = (1, 1),
               attention_impl: str = "xla", layout: sharding_lib.Layout | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> (h, k_cache, v_cache, k, v).

    `k_cache` / `v_cache` [B * K, C, H] (on a mesh [B, K, C, H]) are this layer's
    `KVCache` arrays and
    k, v [B, T, K, H] the new tokens' keys / values. With `write_cache` the new
    tokens go into the cache first (slots `starts + t`) and attention reads it;
    without, the cache is only read and comes back as it was. Short forwards
    go to `attention.short_attention` (`masks`: the dense form's, `(mask
    [B, T, C],)` written, `(cache_mask [B, C], new_mask [B, T, T])` read-only).
    `masks = None` takes `attention.blockwise_attention`
    (long forwards), which builds its masks per tile from `starts` and
    `block_mask` [B, T, T] (None: causal). `groups` = (head groups, MLP
    groups): the column groups of `wqkv` / `bqkv` and of `w_gate_up` on a mesh
    (`sharding.interleave_columns`; (1, 1) = the standard layout).
    `attention_impl`: see `attention.ATTENTION_IMPLS`. `layout`: the mesh
    placement, on which the cache write and attention run per shard
    (`sharding.per_shard`); None on one device.
    """
    c = config
    b, t, _ = h.shape
    eps = c.rms_norm_eps
    mm = self._product
    x = rms_norm(h, self.attn_norm[...], eps)
    qkv = mm(x, "wqkv")
    if self.bqkv is not None:
      qkv = qkv + self.bqkv[...]
    q, k, v = _split_qkv(qkv, config=c, groups=groups[0])
    if self.q_norm is not None:
      q = rms_norm(q, self.q_norm[...], eps)
      k = rms_norm(k, self.k_norm[...], eps)
    q = rope_lib.apply_rope(q, cos, sin)
    k = rope_lib.apply_rope(k, cos, sin)
    attend = functools.partial(_attend, write_cache=write_cache, attention_impl=attention_impl)
    if layout is not None:
      # Each device writes and attends its own rows x kv heads of the cache.
      attend = sharding_lib.per_shard(attend, layout=layout)
    out, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, starts, masks, block_mask)
    h = h + mm(out, "wo")
    x = rms_norm(h, self.mlp_norm[...], eps)
    gate, up = _split_gate_up(mm(x, "w_gate_up"), groups=groups[1])
    h = h + mm(jax.nn.silu(gate) * up, "w_down")
    return h, k_cache, v_cache, k, v

  def _product(self, x: jax.Array, name: str) -> jax.Array:
    """x [..., K] times the layer matrix `name` -> [..., N] in x's dtype."""
    w = getattr(self, name)[...]
    scale = getattr(self, name + SCALE_SUFFIX)
    if scale is not None:
      return int8_lib.product(x, w, scale[...], contract=0).astype(x.dtype)
    return (dense_out_major if self.out_major else dense)(x, w)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
            starts: jax.Array, masks: tuple[jax.Array, ...] | None,
            block_mask: jax.Array | None, *, write_cache: bool, attention_impl: str
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One layer's cache write and attention: (out [B, T, N * H], k_cache, v_cache).

  q [B, T, N, H]; k, v [B, T, K, H]; caches [B * K, C, H], or [B, K, C, H] on a
  mesh (one shard's rows and kv heads, `sharding.per_shard`), which the
  attention forms read through its row-major [B * K, C, H] view.
  """
  t = q.shape[1]
  if write_cache:
    k_cache, v_cache = kv_lib.write_kv(k_cache, v_cache, k, v, starts)
  kc, vc = (x.reshape((-1,) + x.shape[-2:]) for x in (k_cache, v_cache))  # [B * K, C, H]
  prefill = attention_kernels_lib.prefill_impl(attention_impl, kc.dtype)
  if prefill != "xla" and write_cache and t == kc.shape[1]:
    # A forward that fills the whole cache starts at slot 0 (prefill).
    out = attention_lib.prefill_attention(
        q, k.astype(kc.dtype), v.astype(vc.dtype), block_mask=block_mask, impl=prefill)
  elif masks is None:
    out = attention_lib.blockwise_attention(
        q, k_cache=kc, v_cache=vc, starts=starts, block_mask=block_mask,
        new_kv=None if write_cache else (k, v))
  else:
    out = attention_lib.short_attention(q, k, v, k_cache=kc, v_cache=vc, starts=starts,
                                        block_mask=block_mask, masks=masks,
                                        written=write_cache, impl=attention_impl)
  return out, k_cache, v_cache


def _split_qkv(qkv: jax.Array, *, config: TransformerConfig, groups: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """[B, T, Q + 2 KV] -> q [B, T, N, H], k, v [B, T, K, H].

  With g > 1 groups the columns are group-major (each group: its q heads, its
  k heads, its v heads), so a tensor shard slices its own heads locally.
  """
  c = config
  b, t, _ = qkv.shape
  g = groups
  qkv = qkv.reshape(b, t, g, -1)
  q_size, kv_size = c.q_size // g, c.kv_size // g
  q = qkv[..., :q_size].reshape(b, t, c.num_heads, c.head_dim)
  k = qkv[..., q_size:q_size + kv_size].reshape(b, t, c.num_kv_heads, c.head_dim)
  v = qkv[..., q_size + kv_size:].reshape(b, t, c.num_kv_heads, c.head_dim)
  return q, k, v


def _split_gate_up(x: jax.Array, *, groups: int) -> tuple[jax.Array, jax.Array]:
  """[..., 2 F] -> gate, up [..., F] (group-major columns with groups > 1)."""
  if groups == 1:
    return jnp.split(x, 2, axis=-1)
  lead = x.shape[:-1]
  x = x.reshape(lead + (groups, 2, -1))
  return x[..., 0, :].reshape(lead + (-1,)), x[..., 1, :].reshape(lead + (-1,))


def is_half(dtype) -> bool:
  """Whether `dtype` is a 16-bit float (bf16 / f16): weights stored so take the 16-bit paths."""
  return jnp.dtype(dtype).itemsize == 2


# A tied head over a few rows (verification widths 2-5, a block drafter's
# positions) is faster on XLA:CPU computed as rows [V, D] @ h.T, the matrix on
# the left, than as h @ rows.T; for one row the two are alike, and from about
# 9 rows the usual form is faster again. The barrier keeps XLA from folding the
# transpose of the small [V, rows] result back into the product. The same holds
# for 16-bit rows, a target's head and a drafter's restricted head alike
# (docs/design.md §Choices for XLA:CPU).
WEIGHTS_LEFT_MAX_ROWS = 8
# 16-bit rows go on the left up to this many rows (measured faster up to 256,
# a 1,024-token prompt's prefill included; beyond, the [V, rows] result's
# transpose grows with the rows: a training batch keeps the usual form).
HALF_WEIGHTS_LEFT_MAX_ROWS = 512


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def f32_dot_general(x: jax.Array, w: jax.Array, dimension_numbers) -> jax.Array:
  """`lax.dot_general` accumulated and returned in f32, differentiated in x's dtype.

  Plain autodiff would carry the f32 output's cotangent into both backward
  products and run them in f32; with 16-bit operands (mixed-precision
  training) the cotangent is rounded to their dtype first, so the backward
  products run at 16-bit speed like the forward one. With f32 operands this
  is `lax.dot_general` exactly.
  """
  return jax.lax.dot_general(x, w, dimension_numbers, preferred_element_type=jnp.float32)


def _f32_dot_general_fwd(x, w, dimension_numbers):
  return f32_dot_general(x, w, dimension_numbers), (x, w)


def _f32_dot_general_bwd(dimension_numbers, residuals, cotangent):
  x, w = residuals
  _, pullback = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), x, w)
  return pullback(cotangent.astype(jnp.result_type(x, w)))


f32_dot_general.defvjp(_f32_dot_general_fwd, _f32_dot_general_bwd)


def _product(x: jax.Array, w: jax.Array, contract: int) -> tuple[jax.Array, Any]:
  """x [..., K] times w along w's axis `contract` (K), accumulated in f32.

  With 16-bit weights and activations of another dtype, x is rounded to the
  weights' dtype (the operands of one product share a dtype) and the product
  accumulates in f32. A product of a single row with 16-bit weights is padded
  to two: XLA:CPU's matrix-vector kernel has no fast 16-bit path (about 10x
  slower than f32), while its 2-row matrix product streams the half-size
  weights at the speed of an f32 matrix-vector product. The product then
  gives a row the same bits whether it arrives alone or with others (XLA:CPU's
  f32 matrix-vector kernel does not: it differs from the matrix product in the
  last bits). Those forms are XLA:CPU's (`models.cpu_kernels`); in the
  standard form the product is one `dot_general`.

  Returns:
    (f32 product [..., N], x's original dtype).
  """
  out_dtype = x.dtype
  if x.dtype != w.dtype:
    x = x.astype(w.dtype)
  lead = x.shape[:-1]
  rows = int(np.prod(lead)) if lead else 1
  flat = x.reshape(rows, x.shape[-1])
  half = is_half(w.dtype)
  if not cpu_kernels_lib.active():
    out = f32_dot_general(flat, w, (((1,), (contract,)), ((), ())))
    return out.reshape(lead + (out.shape[-1],)), out_dtype
  if rows == 1 and half:
    flat = jnp.concatenate([flat, jnp.zeros_like(flat)], axis=0)
  if contract == 1 and (1 < rows <= WEIGHTS_LEFT_MAX_ROWS
                        or half and rows <= HALF_WEIGHTS_LEFT_MAX_ROWS):
    # w [N, K] @ flat.T: see WEIGHTS_LEFT_MAX_ROWS and LAYER_MATRICES.
    out = jnp.transpose(jax.lax.optimization_barrier(
        f32_dot_general(w, flat, (((1,), (1,)), ((), ())))))[:rows]
  else:
    out = f32_dot_general(flat, w, (((1,), (contract,)), ((), ())))[:rows]
  return out.reshape(lead + (out.shape[-1],)), out_dtype


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N] in x's dtype (f32 accumulation).

  See `_product` for weights stored in another (16-bit) dtype.
  """
  if x.dtype == w.dtype and not is_half(w.dtype):
    return x @ w
  out, dtype = _product(x, w, 0)
  return out.astype(dtype)


def dense_out_major(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] @ w [N, K].T -> [..., N] in x's dtype: a matrix held out-major."""
  return project_rows(x, w).astype(x.dtype)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """table[ids] along axis 0: [V, D], ids [...] -> [..., D] in table's dtype.

  A 16-bit table is gathered as its raw 16-bit patterns. Gathered as bf16,
  XLA:CPU converts the whole table to f32 for the gather and hoists that out
  of the loop around it: a conversion of the whole embedding where a few rows
  are read (an EAGLE-3 drafting stage on a bf16 target paid it every stage).
  """
  if not is_half(table.dtype) or not cpu_kernels_lib.active():
    return jnp.take(table, ids, axis=0)
  # Tied to the ids, the table is no loop invariant: XLA cannot hoist (and
  # materialize) its reinterpretation out of a decode loop.
  table, ids = jax.lax.optimization_barrier((table, ids))
  bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), ids, axis=0)
  return jax.lax.bitcast_convert_type(bits, table.dtype)


def project_rows(hidden: jax.Array, rows: jax.Array) -> jax.Array:
  """hidden [..., D] @ rows[V, D].T -> f32 [..., V], without transposing `rows`.

  Tied heads read the embedding [V, D] as is: `embed.T` would make XLA copy the
  whole matrix (113 MB for SmolLM2) in every forward on CPU.
  """
  out, _ = _product(hidden, rows, 1)  # accumulated and returned in f32
  return out


def _split_layers(stacked: Mapping[str, jax.Array | np.ndarray], num_layers: int, *,
                  out_major: bool, put=lambda name, w: jnp.asarray(w)) -> nnx.List:
  """Stacked weights -> one `DecoderLayer` each; `put(name, layer's array)` places them.

  With `out_major` the layer matrices of `stacked` are already transposed.
  """
  return nnx.List([DecoderLayer({name: put(f"layers.{name}", w[i]) for name, w in stacked.items()},
                                out_major=out_major)
                   for i in range(num_layers)])


def _swap_matrix_axes(stacked: dict[str, Any]) -> dict[str, Any]:
  """Layer matrices [L, K, N] <-> [L, N, K] (`LAYER_MATRICES`); the rest as is."""
  return {name: (w.swapaxes(-1, -2) if name in LAYER_MATRICES else w)
          for name, w in stacked.items()}


# Causal forwards over more tokens than this (prefill of long prompts) run in
# chunks of this many tokens (`Transformer._chunked`).
PREFILL_CHUNK = 1024


def _in_own_kernel_forms(method):
  """Traces a `Transformer` method in the product forms its `cpu_kernels` asks for."""

  @functools.wraps(method)
  def traced(self, *args, **kwargs):
    with cpu_kernels_lib.use(cpu_kernels_lib.resolve(self.cpu_kernels)):
      return method(self, *args, **kwargs)

  return traced


class Transformer(nnx.Module):
  """Decoder-only LM whose forward takes and returns an explicit KV cache."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs | None = None,
               dtype=jnp.float32, weight_dtype=None, init_std: float = 0.02,
               cache_dtype=None, attention_impl: str = "xla", cpu_kernels: bool | None = None):
    """Random initialisation (loaders use `from_params`).

    Args:
      config: the architecture.
      rngs: initialisation keys.
      dtype: activations, KV cache, norms and biases.
      weight_dtype: storage of the weight matrices (`MATRIX_WEIGHTS`); None =
        `dtype`. bf16 matrices with f32 activations halve the bytes a forward
        streams; products then accumulate in f32 (see `dense`). int8 stores
        each matrix as int8 values with a scale per output channel, a quarter
        of the f32 bytes (`models.int8`).
      init_std: above the usual 0.02 gives tiny test targets peaked,
        non-uniform next-token distributions, so drafters have something to
        learn.
      cache_dtype: the KV cache's dtype (None = `dtype`); bf16 halves the
        bytes a decode step reads from the cache.
      attention_impl: "xla" (default), "cudnn", "dot_product" or "pallas_tpu"; see
        `models.attention_kernels`.
      cpu_kernels: write forwards in XLA:CPU's forms (True), in the standard
        form (False), or as this process's backend wants (None); see
        `models.cpu_kernels`. It decides how 16-bit matrices are stored.
    """
    if attention_impl not in attention_lib.ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {attention_lib.ATTENTION_IMPLS},"
                       f" not {attention_impl!r}.")
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = config
    self.dtype = dtype
    self.weight_dtype = jnp.dtype(dtype if weight_dtype is None else weight_dtype)
    self.cache_dtype = jnp.dtype(dtype if cache_dtype is None else cache_dtype)
    self.attention_impl = attention_impl
    self.cpu_kernels = cpu_kernels
    self.layout: sharding_lib.Layout | None = None  # a mesh placement (`from_params(mesh=)`)
    c = config
    init = nnx.initializers.normal(init_std)
    self._set_matrix("embed", init(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
    stacked = random_layer_weights(c, rngs=rngs, dtype=dtype, init_std=init_std)
    stacked = self._stored_layers(stacked)
    if self.out_major:
      stacked = _swap_matrix_axes(stacked)
    self.layers = _split_layers(stacked, c.num_layers, out_major=self.out_major)
    self.final_norm = nnx.Param(jnp.ones((c.hidden_size,), dtype))
    if c.tie_embeddings:
      self.lm_head = self.lm_head_scale = None
    else:
      self._set_matrix("lm_head", init(rngs.params(), (c.hidden_size, c.vocab_size), dtype))

  def _stored(self, name: str, value) -> dict[str, Any]:
    """Parameter `name` (`param_shapes` names) as stored: {name: value in its storage
    dtype}, and for an int8 matrix also {name + SCALE_SUFFIX: its scales}
    (`models.int8`)."""
    dtype = self.weight_dtype if name in MATRIX_WEIGHTS else self.dtype
    if int8_lib.is_int8(dtype):
      values, scale = int8_lib.quantize(value, axis=_CONTRACTED_AXIS[name])
      return {name: values, name + SCALE_SUFFIX: scale}
    if isinstance(value, np.ndarray):
      return {name: np.asarray(value, dtype)}
    return {name: jnp.asarray(value, dtype)}

  def _stored_layers(self, stacked: Mapping[str, Any]) -> dict[str, Any]:
    """Stacked layer weights ({"wqkv": [L, K, N], ...}) as stored (`_stored`)."""
    out = {}
    for name, value in stacked.items():
      out.update({key.split(".", 1)[1]: v
                  for key, v in self._stored(f"layers.{name}", value).items()})
    return out

  def _set_matrix(self, name: str, value, put=lambda name, value: value) -> None:
    """Stores "embed" / "lm_head" (and its scales where int8) as parameters."""
    stored = self._stored(name, value)
    setattr(self, name, nnx.Param(put(name, stored[name])))
    scale = stored.get(name + SCALE_SUFFIX)
    setattr(self, name + SCALE_SUFFIX,
            None if scale is None else nnx.Param(put(name + SCALE_SUFFIX, scale)))

  def matrix(self, name: str) -> jax.Array:
    """The float values of "embed" [V, D] or "lm_head" [D, V]: the stored matrix, or an
    int8 one dequantized to `dtype` (drafters that share the target's embedding
    or head copy it from here)."""
    values = getattr(self, name)[...]
    scale = getattr(self, name + SCALE_SUFFIX)
    if scale is None:
      return values
    axis = _CONTRACTED_AXIS[name]
    return (values.astype(jnp.float32)
            * jnp.expand_dims(scale[...], axis)).astype(self.dtype)

  # ----------------------------------------------------------------- weights
  @property
  def out_major(self) -> bool:
    """Whether the layers hold their matrices transposed (16-bit storage in XLA:CPU's
    form, `LAYER_MATRICES`)."""
    return is_half(self.weight_dtype) and cpu_kernels_lib.resolve(self.cpu_kernels)

  @property
  def int8(self) -> bool:
    """Whether the weight matrices are int8 with per-channel scales (`models.int8`)."""
    return int8_lib.is_int8(self.weight_dtype)

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    """The mesh the weights are split over (None: one device)."""
    return self.layout.mesh if self.layout is not None else None

  @property
  def _attention(self) -> str:
    """The attention its forwards trace: on a mesh the XLA forms, as the per-device body of
    `sharding.per_shard` (the library kernels there are untried)."""
    return self.attention_impl if self.layout is None else "xla"

  @property
  def _groups(self) -> tuple[int, int]:
    lay = self.layout
    return (lay.head_groups, lay.mlp_groups) if lay is not None else (1, 1)

  @classmethod
  def from_params(cls, config: TransformerConfig, params: Mapping[str, np.ndarray], *,
                  dtype=jnp.float32, weight_dtype=None, source: str = "",
                  mesh: jax.sharding.Mesh | None = None, cache_dtype=None,
                  attention_impl: str = "xla", cpu_kernels: bool | None = None
                  ) -> "Transformer":
    """Builds a model from a flat `{name: array}` dict in `param_shapes` layout.

    `dtype`, `weight_dtype`, `cache_dtype`, `attention_impl` and
    `cpu_kernels` as in the constructor. With `mesh`, each
    weight goes from host memory straight to its shards
    (`models.sharding`): no device ever holds a whole matrix it does not own,
    and the model's forwards and caches follow that placement.
    """
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
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype,
                                       weight_dtype=weight_dtype, cache_dtype=cache_dtype,
                                       attention_impl=attention_impl,
                                       cpu_kernels=cpu_kernels))
    lay = sharding_lib.layout(config, mesh) if mesh is not None else None
    model.layout = lay

    out_major = model.out_major

    def put(name, value):
      if lay is None:
        return jnp.asarray(value)
      if name.endswith(SCALE_SUFFIX):  # split as its matrix's output channels
        matrix = name[:-len(SCALE_SUFFIX)]
        spec = tuple(sharding_lib.param_spec(matrix, config, lay))
        contracted = _CONTRACTED_AXIS[matrix] - matrix.startswith("layers.")
        spec = jax.sharding.PartitionSpec(
            *(s for i, s in enumerate(spec) if i != contracted))
      else:
        spec = sharding_lib.param_spec(name, config, lay)
      if out_major and name in _STACKED_LAYER_MATRICES:
        spec = jax.sharding.PartitionSpec(*reversed(spec))  # the same dimension split
      return sharding_lib.place(np.asarray(value), spec, lay.mesh)

    model._set_matrix("embed", np.asarray(params["embed"]), put)
    model.final_norm = nnx.Param(put("final_norm", np.asarray(params["final_norm"], dtype)))
    if "lm_head" in params:
      model._set_matrix("lm_head", np.asarray(params["lm_head"]), put)
    stacked = {}
    for name, value in params.items():
      if name.startswith("layers."):
        value = np.asarray(value)
        if lay is not None and name in sharding_lib.fused_blocks(config):
          value = sharding_lib.interleave_columns(
              value, sharding_lib.fused_blocks(config)[name], sharding_lib.groups_of(name, lay))
        stacked[name.split(".", 1)[1]] = value
    stacked = model._stored_layers(stacked)
    if out_major:
      stacked = _swap_matrix_axes(stacked)
    model.layers = _split_layers(stacked, config.num_layers, out_major=out_major, put=put)
    return model

  def flat_params(self) -> dict[str, np.ndarray]:
    """Inverse of `from_params` (int8 matrices come back dequantized to `dtype`)."""
    out = {"embed": np.asarray(self.matrix("embed")),
           "final_norm": np.asarray(self.final_norm[...])}
    if self.lm_head is not None:
      out["lm_head"] = np.asarray(self.matrix("lm_head"))
    stacked = {name: np.stack([np.asarray(l.weights()[name]) for l in self.layers])
               for name in self.layers[0].weights()}
    for name in LAYER_MATRICES:
      if name + SCALE_SUFFIX in stacked:
        stacked[name] = int8_lib.dequantize(
            stacked[name], stacked.pop(name + SCALE_SUFFIX),
            axis=_CONTRACTED_AXIS[f"layers.{name}"], dtype=self.dtype)
    if self.out_major:
      stacked = _swap_matrix_axes(stacked)
    out.update({f"layers.{name}": w for name, w in stacked.items()})
    if self.layout is not None:
      for name, sizes in sharding_lib.fused_blocks(self.config).items():
        if name in out:
          out[name] = sharding_lib.deinterleave_columns(
              out[name], sizes, sharding_lib.groups_of(name, self.layout))
    return out

  def init_cache(self, *, batch_size: int, capacity: int, dtype=None) -> kv_lib.KVCache:
    """An empty cache (`dtype` None: the model's `cache_dtype`); on a mesh
    split over data (rows) and tensor (kv heads)."""
    c = self.config
    cache = kv_lib.KVCache.create(
        num_layers=c.num_layers, batch_size=batch_size, capacity=capacity,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=self.cache_dtype if dtype is None else dtype, split_heads=self.layout is not None)
    if self.layout is None:
      return cache
    sharding_lib.check_batch(batch_size, self.layout.mesh)
    split = jax.sharding.NamedSharding(self.layout.mesh, sharding_lib.kv_spec(self.layout))
    rows = jax.sharding.NamedSharding(self.layout.mesh, sharding_lib.batch_spec(1))
    constrain = jax.lax.with_sharding_constraint
    return kv_lib.KVCache(k=tuple(constrain(x, split) for x in cache.k),
                          v=tuple(constrain(x, split) for x in cache.v),
                          lengths=constrain(cache.lengths, rows))

  # ----------------------------------------------------------------- forward
  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    if self.embed_scale is not None:
      return int8_lib.take_rows(self.embed[...], self.embed_scale[...], tokens, dtype=self.dtype)
    return take_rows(self.embed[...], tokens)

  @_in_own_kernel_forms
  def unembed(self, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> f32 logits [..., V]."""
    if self.lm_head is None:
      if self.embed_scale is not None:
        return int8_lib.product(hidden, self.embed[...], self.embed_scale[...], contract=1)
      return project_rows(hidden, self.embed[...])
    if self.lm_head_scale is not None:
      return int8_lib.product(hidden, self.lm_head[...], self.lm_head_scale[...], contract=0)
    out, _ = _product(hidden, self.lm_head[...], 0)
    return out.astype(jnp.float32)

  @_in_own_kernel_forms
  def __call__(
      self,
      tokens: jax.Array,
      *,
      positions: jax.Array,
      cache: kv_lib.KVCache,
      block_mask: jax.Array | None = None,
      taps: Sequence[int] = (),
      logit_positions: jax.Array | None = None,
      write_cache: bool = True,
      taps_only: bool = False,
      num_valid: jax.Array | None = None,
  ) -> ForwardOutput:
    """Runs T new tokens per row against the cache.

    Long inputs (more than `attention.BLOCKWISE_MIN_QUERIES` tokens) attend
    blockwise, and causal ones that write the cache over more than
    `PREFILL_CHUNK` tokens run in chunks (`_chunked`): memory grows with T
    times a block, not with T times the capacity (see `models.attention`).

    Args:
      tokens: [B, T] token ids.
      positions: [B, T] RoPE positions (usually `cache.lengths[:, None] + t`;
        tree verification passes depths instead).
      cache: KV cache; new tokens go to slots `cache.lengths[b] + t`.
      block_mask: optional [B, T, T] mask among the new tokens (default causal).
      taps: decoder-layer indices whose outputs are returned in `taps`.
      logit_positions: optional [B, N] indices into T: compute logits there only.
      write_cache: False returns `cache` as it came and leaves writing
        `new_kv` to the caller (`cache.append`): a forward inside a branch of
        a `lax.switch` then only reads the cache, which XLA would otherwise
        copy whole for the branch. (Outside a switch, writing first is the
        copy-free order: the write must come before the reads.)
      taps_only: stop after the last tapped layer (building drafter data):
        only `taps` and `new_kv` of the layers run are computed; `logits` and
        `hidden` are empty ([B, 0, ...]) and `cache` is returned as it came.
      num_valid: optional [B] how many of each row's T tokens are real; the
        rest pad the input to a compiled width. A chunked forward then stops
        after the chunk holding the longest row's last real token: chunks
        wholly made of padding are not computed (their `hidden`, `taps` and
        `new_kv` are zeros, their cache slots left as they were). Other
        forwards compute every token.

    Returns:
      A `ForwardOutput`.
    """
    t = tokens.shape[1]
    if (t > PREFILL_CHUNK and write_cache and block_mask is None and not taps_only
        and attention_kernels_lib.prefill_impl(self._attention, cache.k[0].dtype) == "xla"):
      return self._chunked(tokens, positions=positions, cache=cache, taps=taps,
                           logit_positions=logit_positions, num_valid=num_valid)
    return self._forward(tokens, positions=positions, cache=cache, block_mask=block_mask,
                         taps=taps, logit_positions=logit_positions, write_cache=write_cache,
                         taps_only=taps_only)

  def _chunked(self, tokens: jax.Array, *, positions: jax.Array, cache: kv_lib.KVCache,
               taps: Sequence[int], logit_positions: jax.Array | None,
               num_valid: jax.Array | None = None) -> ForwardOutput:
    """A causal forward over a long input in chunks of `PREFILL_CHUNK` tokens.

    A loop runs the chunks in order, each a forward that writes its
    keys / values into the carried cache and attends to what the chunks
    before it wrote: activations are held for one chunk, not for the whole
    input, and one chunk's program is compiled instead of the input's. The
    last chunk is moved back to end at the input's end (it recomputes a few
    tokens, which rewrite the same slots), so no slot past the input is
    written. With `num_valid` the loop stops after the chunk that holds the
    longest row's last real token: a prompt padded to its compiled width
    (7,000 tokens to 8,192) would otherwise pay for the padding's products
    and, worse, for its attention over the whole prompt.
    """
    b, t = tokens.shape
    size = PREFILL_CHUNK
    firsts = np.asarray([min(i * size, t - size) for i in range(-(-t // size))], np.int32)
    starts = cache.lengths

    def chunk(cache, first):
      sl = lambda x: jax.lax.dynamic_slice_in_dim(x, first, size, axis=1)
      o = self._forward(sl(tokens), positions=sl(positions), cache=cache.with_lengths(starts + first),
                        taps=taps, logit_positions=None, write_cache=True, unembed=False)
      return o.cache, (o.hidden, o.taps)

    if num_valid is None:
      cache, (hidden, tapped) = jax.lax.scan(chunk, cache, jnp.asarray(firsts))
    else:
      # The chunks a scan would run, in the same order and at the same
      # offsets, up to the first that reaches the longest row's end.
      run = jnp.minimum((jnp.max(num_valid) + size - 1) // size, len(firsts))
      shapes = jax.eval_shape(chunk, cache, jnp.int32(0))[1]
      stacked = jax.tree.map(lambda x: jnp.zeros((len(firsts),) + x.shape, x.dtype), shapes)

      def body(i, carry):
        cache, outs = carry
        cache, out = chunk(cache, jnp.asarray(firsts)[i])
        return cache, jax.tree.map(lambda buf, x: buf.at[i].set(x), outs, out)

      cache, (hidden, tapped) = jax.lax.fori_loop(0, run, body, (cache, stacked))
    # Token i of the input: chunk `which[i]`, at `offset[i]` in it.
    which = np.minimum(np.arange(t) // size, len(firsts) - 1)
    offset = np.arange(t) - firsts[which]
    hidden = hidden[which, :, offset].swapaxes(0, 1)  # [B, T, D]
    tapped = tapped[which, :, offset].swapaxes(0, 1)
    if logit_positions is not None:
      selected = jnp.take_along_axis(hidden, logit_positions[..., None], axis=1)
    else:
      selected = hidden
    slots = starts[:, None] + jnp.arange(t)[None, :]  # [B, T]

    def new_of(x):  # [B * K, C, H] or [B, K, C, H] -> [B, T, K, H] at the input's slots
      x = x.reshape((b, -1) + x.shape[-2:])
      return jnp.take_along_axis(x, slots[:, None, :, None], axis=2).transpose(0, 2, 1, 3)

    return ForwardOutput(logits=self.unembed(selected), cache=cache.with_lengths(starts + t),
                         taps=tapped, hidden=hidden,
                         new_kv=tuple((new_of(k), new_of(v)) for k, v in zip(cache.k, cache.v)))

  def _forward(self, tokens: jax.Array, *, positions: jax.Array, cache: kv_lib.KVCache,
               block_mask: jax.Array | None = None, taps: Sequence[int] = (),
               logit_positions: jax.Array | None = None, write_cache: bool = True,
               taps_only: bool = False, unembed: bool = True) -> ForwardOutput:
    """`__call__` in one piece; `unembed=False` leaves `logits` empty ([B, 0, V])."""
    c = self.config
    b, t = tokens.shape
    starts = cache.lengths
    if attention_lib.use_blockwise(t):
      masks = None  # built per tile
    elif write_cache:
      masks = (kv_lib.attention_mask(starts=starts, num_new=t, capacity=cache.capacity,
                                     block_mask=block_mask),)
    else:
      if block_mask is None:
        block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
      masks = (kv_lib.committed_mask(starts=starts, capacity=cache.capacity), block_mask)
    cos, sin = rope_lib.rope_angles(positions, rope_lib.inverse_frequencies(c))
    h = self.embed_tokens(tokens).astype(self.dtype)
    num_layers = len(self.layers)
    wanted = {i % num_layers for i in taps}
    if taps_only and not wanted:
      raise ValueError("taps_only needs taps.")
    run = max(wanted) + 1 if taps_only else num_layers
    k_caches, v_caches, new_kv, layer_outputs = [], [], [], {}
    for i, layer in enumerate(self.layers[:run]):
      h, k_cache, v_cache, k, v = layer(
          h, config=c, cos=cos, sin=sin, k_cache=cache.k[i], v_cache=cache.v[i],
          starts=starts, masks=masks, block_mask=block_mask, write_cache=write_cache,
          groups=self._groups, attention_impl=self._attention, layout=self.layout)
      k_caches.append(k_cache)
      v_caches.append(v_cache)
      new_kv.append((k, v))
      if i in wanted:
        layer_outputs[i] = h
    if taps:
      tapped = jnp.stack([layer_outputs[i % num_layers] for i in taps], axis=2)  # [B, T, n, D]
    else:
      tapped = jnp.zeros((b, t, 0, c.hidden_size), h.dtype)
    if taps_only:
      return ForwardOutput(logits=jnp.zeros((b, 0, c.vocab_size), jnp.float32), cache=cache,
                           taps=tapped, hidden=h[:, :0], new_kv=tuple(new_kv))
    hidden = rms_norm(h, self.final_norm[...], c.rms_norm_eps)
    if not unembed:
      selected = hidden[:, :0]
    elif logit_positions is not None:
      selected = jnp.take_along_axis(hidden, logit_positions[..., None], axis=1)
    else:
      selected = hidden
    logits = self.unembed(selected) if unembed else jnp.zeros((b, 0, c.vocab_size), jnp.float32)
    if write_cache:
      cache = kv_lib.KVCache(k=tuple(k_caches), v=tuple(v_caches), lengths=starts + t)
    return ForwardOutput(logits=logits, cache=cache, taps=tapped, hidden=hidden,
                         new_kv=tuple(new_kv))


def tiny_target(*, seed: int = 0, init_std: float = 0.3, **overrides) -> Transformer:
  """A tiny random target with peaked next-token distributions (tests, tiny configs)."""
  return Transformer(tiny_config(**overrides), rngs=nnx.Rngs(seed), init_std=init_std)


def tiny_target_name(*, seed: Any, init_std: Any, **overrides: Any) -> str:
  """The name of `tiny_target(seed=..., init_std=..., **overrides)`: its weights depend on
  seed, scale and shape, and a drafter or dataset made for one fits no other."""
  extra = "".join(f",{k}={overrides[k]}" for k in sorted(overrides))
  return f"tiny(seed={seed},init_std={init_std}{extra})"
