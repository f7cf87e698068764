"""Attention of a target's new tokens over its KV cache.

Formulations of the same function, chosen by the shape of a forward and by
the form the forward is written in (`models.cpu_kernels`):

  short forwards (decode steps, verification of drafts and trees, T up to
    `BLOCKWISE_MIN_QUERIES` new tokens):
      standard form (accelerator profiles): `bounded_attention`, an online
        softmax over key blocks of the cache whose trip count stops at the
        block of the longest row's last visible slot: work and score memory
        grow with the committed length, not with the capacity. A forward
        that only reads the cache adds the new tokens' own block (chain or
        tree mask) last, merged by the same online softmax.
      XLA:CPU form: one score matrix [B, K, G, T, C] over every slot of the
        cache (`cached_attention`, or `attention_with_new` when the forward
        only reads the cache), measured faster there for caches the engine
        sized close to the context (capacity buckets, and a ladder of
        capacities in `decoding.plan.cache_ladder`) up to
        `CPU_BOUNDED_MIN_CAPACITY` slots; larger ones take
        `bounded_attention` there too (`dense_short_forwards`).
    Either way one fixed shape keeps a forward's arithmetic the same in
    every decoding mode: a row's result depends on its own visible slots
    only, never on other rows' lengths.
  long forwards (prefill, drafter data builds): `blockwise_attention`, an
    online softmax over key blocks of query blocks. Memory is O(T * block),
    not O(T * C), and a query block only visits the key blocks it can see
    (a causal prefill does about half the work of the full square).
  `attention_impl="cudnn"`: forwards that fill a fresh cache (prefill: T = C)
    go to `jax.nn.dot_product_attention` (cuDNN flash attention on GPU);
    "dot_product" is the same call with XLA's implementation, its CPU twin.

Masks of long forwards and of `bounded_attention` are built per key block
from the rows' starts (and from the block's part of `block_mask`), never as a
dense [T, C] boolean.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dloop_jax.models import attention_kernels
from dloop_jax.models import cpu_kernels

# Attention implementations a target may be built with (`Transformer(attention_impl=)`).
ATTENTION_IMPLS = ("xla", "cudnn", "dot_product", "pallas_tpu")

# Forwards with more new tokens than this use `blockwise_attention`. Decode
# steps, verifications and trees stay below it, so their arithmetic (and the
# bit-identity of decoding modes at a fixed width) does not depend on it. Up
# to it the dense scores are small, and the dense program is smaller: the
# blockwise loops add machine code to every program with a prefill, and a
# process that compiles many (a benchmark of many methods) runs out of the
# memory mappings XLA:CPU's executables hold.
BLOCKWISE_MIN_QUERIES = 512
# Query and key block sizes of `blockwise_attention`.
QUERY_BLOCK = 512
KEY_BLOCK = 512


def use_blockwise(num_new: int) -> bool:
  """Whether a forward of `num_new` tokens per row takes `blockwise_attention`."""
  return num_new > BLOCKWISE_MIN_QUERIES


def _ceil_div(a, b):
  return (a + b - 1) // b


def _empty_state(pairs: int, queries: int, head_dim: int):
  """(running max, normalizer, weighted sum of values) of an online softmax, before any key.

  The finite floor of the max keeps exp(m - m_new) defined before a row saw a key.
  """
  return (jnp.full((pairs, queries), jnp.finfo(jnp.float32).min, jnp.float32),
          jnp.zeros((pairs, queries), jnp.float32),
          jnp.zeros((pairs, queries, head_dim), jnp.float32))


def _online_step(state, s: jax.Array, v: jax.Array):
  """One key block of an online softmax: scores s [n, q, kb] (f32, -inf where hidden), v [n, kb, H].

  A block every one of whose keys is hidden from a query adds exactly nothing
  to that query's state (p = 0, alpha = 1): a row's result does not depend
  on how many trailing blocks other rows made the loop run.
  """
  m, l, acc = state  # [n, q], [n, q], [n, q, H]
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  p = jnp.exp(s - m_new[..., None])
  alpha = jnp.exp(m - m_new)
  l = alpha * l + jnp.sum(p, axis=-1)
  acc = alpha[..., None] * acc + jnp.einsum(
      "nqk,nkh->nqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l, acc


def _sees_new(block_mask: jax.Array | None, rel: jax.Array, t_idx: jax.Array, *,
              batch: int) -> jax.Array:
  """[B, q, k] whether new token t_idx [q] sees new token rel [B or 1, 1, k] (valid in 0..T-1).

  Causal when `block_mask` [B, T, T] is None; out-of-range `rel` gives an
  arbitrary answer the caller masks.
  """
  if block_mask is None:
    return rel <= t_idx[None, :, None]
  t = block_mask.shape[1]
  rows = jnp.take(block_mask, jnp.minimum(t_idx, t - 1), axis=1)  # [B, q, T]
  rel = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (batch, t_idx.shape[0], rel.shape[-1]))
  return jnp.take_along_axis(rows, rel, axis=2)


def blockwise_attention(q: jax.Array, *, k_cache: jax.Array, v_cache: jax.Array,
                        starts: jax.Array, block_mask: jax.Array | None = None,
                        new_kv: tuple[jax.Array, jax.Array] | None = None,
                        query_block: int | None = None,
                        key_block: int | None = None) -> jax.Array:
  """Attention of T new tokens per row, an online softmax over key blocks.

  New token t of row b sits at slot `starts[b] + t`; it sees the committed
  slots (`j < starts[b]`) and the new tokens allowed by `block_mask[b, t]`
  (causal when None), as `kv_cache.attention_mask` describes. Queries go in
  blocks of `query_block` (a `lax.map`); each block runs a loop over key
  blocks of `key_block` slots whose trip count stops at the last slot any
  row of the block can see, carrying the running max, normalizer and
  weighted sum of the values (f32).

  Args:
    q: [B, T, N, H] queries.
    k_cache, v_cache: [B * K, C, H] one layer's cache.
    starts: [B] slot of each row's first new token.
    block_mask: optional [B, T, T] visibility among the new tokens.
    new_kv: the new tokens' (keys, values) [B, T, K, H] when the cache does
      not hold them (a read-only forward: slots past `starts` are stale);
      None when they were written at `starts + t`.
    query_block, key_block: block sizes (default `QUERY_BLOCK`, `KEY_BLOCK`).

  Returns:
    [B, T, N * H] in q's dtype.
  """
  b, t, n, h = q.shape
  nk, capacity, _ = k_cache.shape
  kv_heads = nk // b
  g = n // kv_heads
  qb = min(query_block or QUERY_BLOCK, t)
  kb = min(key_block or KEY_BLOCK, capacity)
  num_q_blocks = _ceil_div(t, qb)
  t_pad = num_q_blocks * qb
  compute = k_cache.dtype
  # [B * K, G, T', H], pre-scaled; padded queries are computed and dropped.
  qg = (q * (h ** -0.5)).astype(compute).reshape(b, t, kv_heads, g, h)
  qg = jnp.pad(qg, ((0, 0), (0, t_pad - t), (0, 0), (0, 0), (0, 0)))
  qg = qg.transpose(0, 2, 3, 1, 4).reshape(nk, g, t_pad, h)
  max_start, min_start = jnp.max(starts), jnp.min(starts)
  if new_kv is not None:
    kn, vn = (jnp.transpose(x, (0, 2, 1, 3)).reshape(nk, t, h).astype(compute) for x in new_kv)
    kbn = min(kb, t)
    num_new_blocks = _ceil_div(t, kbn)
    pad = ((0, 0), (0, num_new_blocks * kbn - t), (0, 0))
    kn, vn = jnp.pad(kn, pad), jnp.pad(vn, pad)

  def allowed(rel, t_idx):
    return _sees_new(block_mask, rel, t_idx, batch=b)

  def update(state, q_i, k_j, v_j, visible):
    """One key tile: k_j, v_j [B * K, kb, H]; visible [B, qb, kb] (None: all)."""
    s = jnp.einsum("nqh,nkh->nqk", q_i, k_j, preferred_element_type=jnp.float32)
    if visible is not None:
      s = s.reshape(b, kv_heads, g, qb, -1)
      s = jnp.where(visible[:, None, None], s, -jnp.inf).reshape(nk, g * qb, -1)
    return _online_step(state, s, v_j)

  def one_query_block(i):
    q_i = jax.lax.dynamic_slice_in_dim(qg, i * qb, qb, axis=2).reshape(nk, g * qb, h)
    t_idx = i * qb + jnp.arange(qb)
    last_new = jnp.minimum((i + 1) * qb, t) if block_mask is None else t
    state = _empty_state(nk, g * qb, h)

    def full_block(j, state):
      k_j = jax.lax.dynamic_slice_in_dim(k_cache, j * kb, kb, axis=1)
      v_j = jax.lax.dynamic_slice_in_dim(v_cache, j * kb, kb, axis=1)
      return update(state, q_i, k_j, v_j, None)

    def cache_block(j, state):
      # The last block is moved back to fit the cache; slots an earlier block
      # covered are masked out of it.
      lo = j * kb
      first = jnp.minimum(lo, capacity - kb)
      k_j = jax.lax.dynamic_slice_in_dim(k_cache, first, kb, axis=1)
      v_j = jax.lax.dynamic_slice_in_dim(v_cache, first, kb, axis=1)
      slots = (first + jnp.arange(kb))[None, None, :]  # [1, 1, kb]
      start = starts[:, None, None]
      visible = slots < start
      if new_kv is None:
        rel = slots - start
        visible = visible | ((rel >= 0) & (rel < t) & allowed(rel, t_idx))
      return update(state, q_i, k_j, v_j, visible & (slots >= lo))

    # Key blocks every query of the block sees in every row need no mask.
    seen_by_all = min_start + (i * qb if new_kv is None and block_mask is None else 0)
    num_full = jnp.minimum(seen_by_all // kb, capacity // kb)
    state = jax.lax.fori_loop(0, num_full, full_block, state)
    seen = max_start if new_kv is not None else max_start + last_new
    state = jax.lax.fori_loop(num_full, _ceil_div(jnp.minimum(seen, capacity), kb), cache_block,
                              state)
    if new_kv is not None:
      def new_block(j, state):
        k_j = jax.lax.dynamic_slice_in_dim(kn, j * kbn, kbn, axis=1)
        v_j = jax.lax.dynamic_slice_in_dim(vn, j * kbn, kbn, axis=1)
        rel = (j * kbn + jnp.arange(kbn))[None, None, :]
        return update(state, q_i, k_j, v_j, (rel < t) & allowed(rel, t_idx))
      state = jax.lax.fori_loop(0, _ceil_div(last_new, kbn), new_block, state)
    _, l, acc = state
    # A row that saw no key (only padding rows can) gets zeros, not 0 / 0.
    return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B * K, G * qb, H]

  out = jax.lax.map(one_query_block, jnp.arange(num_q_blocks))  # [nQ, B * K, G * qb, H]
  out = out.reshape(num_q_blocks, b, kv_heads, g, qb, h).transpose(1, 0, 4, 2, 3, 5)
  return out.reshape(b, t_pad, n * h)[:, :t].astype(q.dtype)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_mask: jax.Array | None,
                      impl: str) -> jax.Array:
  """`jax.nn.dot_product_attention` of a forward that fills a fresh cache (starts 0).

  cuDNN's flash kernels take 16-bit operands: f32 activations are rounded to
  bf16 for them.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] (in the cache's dtype).
    block_mask: optional [B, T, T] (causal when None).
    impl: "cudnn" or "dot_product" (XLA's implementation).

  Returns:
    [B, T, N * H] in q's dtype.
  """
  attention_kernels.note("cudnn" if impl == "cudnn" else "dot_product")
  b, t, n, h = q.shape
  dtype = q.dtype
  if impl == "cudnn":
    operands = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in (q, k, v)]
  else:
    operands = [q.astype(k.dtype), k, v]
  mask = None if block_mask is None else block_mask[:, None]
  out = jax.nn.dot_product_attention(*operands, mask=mask, is_causal=block_mask is None,
                                     implementation="cudnn" if impl == "cudnn" else "xla")
  return out.reshape(b, t, n * h).astype(dtype)


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
  scores = _f32_einsum("btkgh,bckh->bkgtc", q, k) * (h ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = _f32_einsum("bkgtc,bckh->btkgh", probs, v).astype(v.dtype)
  return out.reshape(b, t, n * h)


def _f32_einsum(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """An attention product accumulated and returned in f32 whatever the operands' dtype.

  With bf16 activations, the read-only verification (`attention_with_new`:
  two products summed) and the cached one (`cached_attention`: one product)
  then round to bf16 once, at the same place, and agree to f32 precision
  instead of differing by a bf16 rounding of each partial product.
  """
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, N, H] -> [B * K, G * T, H]: the queries of each (row, kv head)."""
  b, t, n, h = q.shape
  g = n // kv_heads
  return q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b * kv_heads, g * t, h)


def _ungroup(out: jax.Array, *, batch: int, num_new: int) -> jax.Array:
  """[B * K, G * T, H] -> [B, T, N * H]."""
  n_kv, _, h = out.shape
  kv_heads = n_kv // batch
  out = out.reshape(batch, kv_heads, -1, num_new, h).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, num_new, -1)


# Both attentions below keep the cache the left operand of their matmuls, in
# the [batch, rows, inner] form XLA:CPU multiplies as is: a reshaped or
# transposed cache operand made XLA copy whole layer caches in every step.


# When many (row, kv head) pairs each read a long cache with a few queries
# (batched decode steps: dataset builds at batch 64), XLA:CPU multiplies the
# cache by the queries several times faster into slot-major scores [n, C, q]
# than into query-major ones [n, q, C] (docs/design.md §Choices for XLA:CPU).
# The softmax still runs over the minor axis of a
# transposed copy (a max over a major axis is as slow as the product was); the
# barrier keeps XLA from folding the transpose back into the product. With a
# few rows the query-major product is as fast or faster, so the shapes decide.
SLOT_MAJOR_MIN_PAIRS = 32
SLOT_MAJOR_MAX_QUERIES = 64


def _slot_major(*, pairs: int, queries: int) -> bool:
  return (pairs >= SLOT_MAJOR_MIN_PAIRS and queries <= SLOT_MAJOR_MAX_QUERIES
          and cpu_kernels.active())


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     mask: jax.Array) -> jax.Array:
  """`attention` over one layer of the target's `KVCache`, new tokens written.

  Args:
    q: [B, T, N, H] queries.
    k_cache, v_cache: [B * K, C, H] (row b's kv heads at b * K .. b * K + K - 1).
    mask: [B, T, C] visibility.

  Returns:
    [B, T, N * H].
  """
  b, t, _, h = q.shape
  kv_heads = k_cache.shape[0] // b
  capacity = k_cache.shape[1]
  q = _group_queries(q, kv_heads)
  if _slot_major(pairs=q.shape[0], queries=q.shape[1]):
    slot_major = jax.lax.optimization_barrier(_f32_einsum("nch,nqh->ncq", k_cache, q))
    scores = jnp.transpose(slot_major, (0, 2, 1)) * (h ** -0.5)
  else:
    scores = _f32_einsum("nch,nqh->nqc", k_cache, q) * (h ** -0.5)
  scores = scores.reshape(b, kv_heads, -1, t, capacity)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
  probs = probs.reshape(b * kv_heads, -1, capacity)
  out = _f32_einsum("nch,nqc->nqh", v_cache, probs).astype(q.dtype)
  return _ungroup(out, batch=b, num_new=t)


def attention_with_new(q: jax.Array, k: jax.Array, v: jax.Array, *, k_cache: jax.Array,
                       v_cache: jax.Array, cache_mask: jax.Array,
                       new_mask: jax.Array) -> jax.Array:
  """Attention over one layer's cache (read only) and over the new tokens.

  One softmax spans both key sets. With committed slots 0..1 of a cache of 4
  (`cache_mask` = [x x . .]) and 2 new tokens, causal ('x' = visible):

      key:   cache0 cache1 cache2 cache3 | new0 new1
      t = 0  x      x      .      .      | x    .
      t = 1  x      x      .      .      | x    x

  Args:
    q: [B, T, N, H] queries.
    k, v: [B, T, K, H] keys / values of the new tokens.
    k_cache, v_cache: [B * K, C, H].
    cache_mask: [B, C] cache slots every new token sees.
    new_mask: [B, T, T] which new tokens each new token sees.

  Returns:
    [B, T, N * H].
  """
  b, t, kv_heads, h = k.shape
  capacity = k_cache.shape[1]
  out_dtype = q.dtype
  q = _group_queries(q, kv_heads)
  # Rounded as the cache would hold them, so that reading them from there
  # (`cached_attention`) gives the same result.
  k = jnp.transpose(k, (0, 2, 1, 3)).reshape(b * kv_heads, t, h).astype(k_cache.dtype)
  v = jnp.transpose(v, (0, 2, 1, 3)).reshape(b * kv_heads, t, h).astype(v_cache.dtype)
  scale = h ** -0.5
  from_cache = _f32_einsum("nch,nqh->nqc", k_cache, q) * scale
  from_new = _f32_einsum("nqh,nsh->nqs", q, k) * scale
  scores = jnp.concatenate([from_cache, from_new], axis=-1).reshape(b, kv_heads, -1, t,
                                                                    capacity + t)
  visible = jnp.concatenate(
      [jnp.broadcast_to(cache_mask[:, None, :], (b, t, capacity)), new_mask], axis=-1)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kv_heads, -1, capacity + t)
  out = (_f32_einsum("nch,nqc->nqh", v_cache, probs[..., :capacity])
         + _f32_einsum("nqs,nsh->nqh", probs[..., capacity:], v)).astype(out_dtype)
  return _ungroup(out, batch=b, num_new=t)




# Key block of `bounded_attention`. Over a cache whose capacity is a multiple
# of it, the slots fall into the same blocks at every capacity, so a row gets
# the same bits whatever the capacity; other capacities take the largest
# common power-of-two divisor (the engine's capacity buckets, 2^k and
# 3 * 2^(k-1), give a block of at least a third of the cache), or, below
# `MIN_DECODE_KEY_BLOCK`, one block of the whole cache.
DECODE_KEY_BLOCK = 256
MIN_DECODE_KEY_BLOCK = 16


def decode_key_block(capacity: int) -> int:
  """The key block `bounded_attention` reads a cache of `capacity` slots in (divides it)."""
  if capacity <= DECODE_KEY_BLOCK:
    return capacity
  block = math.gcd(capacity, DECODE_KEY_BLOCK)
  return block if block >= MIN_DECODE_KEY_BLOCK else capacity


def bounded_attention(q: jax.Array, *, k_cache: jax.Array, v_cache: jax.Array,
                      starts: jax.Array, block_mask: jax.Array | None = None,
                      new_kv: tuple[jax.Array, jax.Array] | None = None,
                      kernel: str | None = None) -> jax.Array:
  """Attention of a short forward that reads only the cache blocks some row can see.

  New token t of row b sits at slot `starts[b] + t` and sees the committed
  slots (`j < starts[b]`) and the new tokens `block_mask[b, t]` allows
  (causal when None), as `kv_cache.attention_mask` describes. An online
  softmax runs over key blocks of `decode_key_block(C)` slots, from slot 0 to
  the block of the last slot any row sees (`max(starts) + T` written,
  `max(starts)` read-only): the work and the f32 scores grow with the
  longest committed length, not with the capacity. Blocks sit at fixed slots
  and every block is masked per slot, so a token's result depends only on the
  slots it sees: a token reads the same blocks in the same order whether it
  is verified among drafts or decoded alone (the bit-identity of decoding
  modes at a fixed width), and blocks past its row's end add exactly zero.

  Read-only (`new_kv` given: slots at and past `starts` are stale), the new
  tokens are one more block after the committed ones, visible by
  `block_mask` (a chain's causal mask or a draft tree's).

  With `kernel` (`attention_kernels.decode_kernel`) a library kernel reads
  the cache instead of the XLA loop: "gpu" the committed slots of a read-only
  forward, or the whole of a one-token written step (Pallas GPU flash
  decoding); "tpu" a one-token written step (Pallas TPU paged attention).
  Both read a length per row; see `attention_kernels` for why written
  forwards of several tokens keep the loop.

  Args:
    q: [B, T, N, H] queries.
    k_cache, v_cache: [B * K, C, H] one layer's cache.
    starts: [B] slot of each row's first new token.
    block_mask: optional [B, T, T] visibility among the new tokens.
    new_kv: the new tokens' (keys, values) [B, T, K, H] when the cache does
      not hold them; None when they were written at `starts + t`.
    kernel: the library kernel of the committed slots (None: the XLA loop).

  Returns:
    [B, T, N * H] in q's dtype.
  """
  b, t, _, h = q.shape
  nk, capacity, _ = k_cache.shape
  kv_heads = nk // b
  kb = decode_key_block(capacity)
  qg = _group_queries(q, kv_heads)  # [B * K, G * T, H]
  scale = h ** -0.5
  t_idx = jnp.arange(t)

  def step(state, keys, values, visible):
    """keys, values [B * K, k, H]; visible [B, T or 1, k]."""
    s = _f32_einsum("nch,nqh->nqc", keys, qg) * scale
    s = s.reshape(b, kv_heads, -1, t, keys.shape[1])
    s = jnp.where(visible[:, None, None], s, -jnp.inf).reshape(nk, -1, keys.shape[1])
    return _online_step(state, s, values)

  def cache_block(j, state):
    lo = j * kb
    keys = jax.lax.dynamic_slice_in_dim(k_cache, lo, kb, axis=1)
    values = jax.lax.dynamic_slice_in_dim(v_cache, lo, kb, axis=1)
    slots = (lo + jnp.arange(kb))[None, None, :]  # [1, 1, kb]
    start = starts[:, None, None]
    visible = slots < start  # [B, 1, kb]
    if new_kv is None:
      rel = slots - start
      visible = visible | ((rel >= 0) & (rel < t) & _sees_new(block_mask, rel, t_idx, batch=b))
    return step(state, keys, values, visible)

  if (kernel in ("tpu", "tpu_interpret") and new_kv is None and t == 1
      and attention_kernels.tpu_supports(capacity=capacity)):
    out = attention_kernels.tpu_step(
        qg, k_cache, v_cache, jnp.repeat(starts + 1, kv_heads, total_repeat_length=nk),
        scale=scale, interpret=kernel == "tpu_interpret")
    return _ungroup(out.astype(q.dtype), batch=b, num_new=t)
  if (kernel in ("gpu", "gpu_interpret") and (new_kv is not None or t == 1)
      and attention_kernels.gpu_supports(capacity=capacity, head_dim=h)):
    lengths = starts + (0 if new_kv is not None else 1)
    state = attention_kernels.gpu_committed(
        qg, k_cache, v_cache, jnp.repeat(lengths, kv_heads, total_repeat_length=nk),
        scale=scale, interpret=kernel == "gpu_interpret")
  else:
    seen = jnp.max(starts) + (t if new_kv is None else 0)
    num_blocks = _ceil_div(jnp.minimum(seen, capacity), kb)
    state = jax.lax.fori_loop(0, num_blocks, cache_block, _empty_state(nk, qg.shape[1], h))
  if new_kv is not None:
    # Rounded as the cache holds them, as `attention_with_new` does.
    kn, vn = (jnp.transpose(x, (0, 2, 1, 3)).reshape(nk, t, h).astype(c.dtype)
              for x, c in zip(new_kv, (k_cache, v_cache)))
    rel = jnp.arange(t)[None, None, :]
    state = step(state, kn, vn, _sees_new(block_mask, rel, t_idx, batch=b))
  _, l, acc = state
  # Every new token sees itself: l > 0.
  return _ungroup((acc / l[..., None]).astype(q.dtype), batch=b, num_new=t)


# XLA:CPU runs the loop of `bounded_attention` (a few small products per key
# block, a carried state) slower than one product over every slot of a cache
# the engine sized close to the context: up to this capacity, at capacities
# that are no multiple of `DECODE_KEY_BLOCK` (a growing cache's 64-slot steps
# give small blocks) and in slot-major batched decoding, its short forwards
# keep the dense scores. In larger caches skipping the slots past the longest
# row pays (SmolLM2-135M, f32, a 2,000-token context, one-token steps: the
# loop 0.88-0.96x the dense step at 3,072 slots, 0.58-0.72x at 8,192, and
# 1.12-1.19x at a growing cache's 2,112 slots in blocks of 64;
# docs/accelerators.md).
CPU_BOUNDED_MIN_CAPACITY = 2048


def dense_short_forwards(*, capacity: int, pairs: int, queries: int) -> bool:
  """Whether a short forward takes the dense scores (XLA:CPU's form) or `bounded_attention`.

  Args:
    capacity: C, the cache's slots.
    pairs: B * K (row, kv head) pairs.
    queries: G * T queries per pair.
  """
  if not cpu_kernels.active():
    return False
  return (capacity < CPU_BOUNDED_MIN_CAPACITY or decode_key_block(capacity) != DECODE_KEY_BLOCK
          or _slot_major(pairs=pairs, queries=queries))


def short_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, k_cache: jax.Array,
                    v_cache: jax.Array, starts: jax.Array, block_mask: jax.Array | None,
                    masks: tuple[jax.Array, ...], written: bool,
                    impl: str = "xla") -> jax.Array:
  """Attention of a short forward (T up to `BLOCKWISE_MIN_QUERIES`) in the traced form.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] the new tokens' keys / values.
    k_cache, v_cache: [B * K, C, H], holding the new tokens at `starts + t`
      when `written`.
    starts: [B]; block_mask: optional [B, T, T] (None: causal).
    masks: the dense form's masks: `(attention_mask [B, T, C],)` written,
      `(committed_mask [B, C], new_mask [B, T, T])` read-only.
    written: whether the cache holds the new tokens.
    impl: the target's `attention_impl` (its library kernels,
      `attention_kernels.decode_kernel`).

  Returns:
    [B, T, N * H].
  """
  b, t, n, _ = q.shape
  pairs, capacity, _ = k_cache.shape
  if dense_short_forwards(capacity=capacity, pairs=pairs, queries=n // (pairs // b) * t):
    if written:
      return cached_attention(q, k_cache, v_cache, *masks)
    cache_mask, new_mask = masks
    return attention_with_new(q, k, v, k_cache=k_cache, v_cache=v_cache, cache_mask=cache_mask,
                              new_mask=new_mask)
  return bounded_attention(q, k_cache=k_cache, v_cache=v_cache, starts=starts,
                           block_mask=block_mask, new_kv=None if written else (k, v),
                           kernel=attention_kernels.decode_kernel(impl, k_cache.dtype))
