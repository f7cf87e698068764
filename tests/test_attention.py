"""Long-input attention (`attention.blockwise_attention`, chunked prefill) against the dense one.

Tiny shapes with tiny blocks: several query blocks, key blocks that do not
divide the cache (the last one moved back), rows at different starts, causal
and tree masks, written and read-only forwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dloop_jax.models import attention
from dloop_jax.models import attention_kernels
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import transformer
from dloop_jax.models.transformer import Transformer

_B, _T, _KV, _G, _H, _C = 3, 11, 2, 3, 8, 29


def _inputs(seed: int):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q = f(_B, _T, _KV * _G, _H)
  k_cache, v_cache = f(_B * _KV, _C, _H), f(_B * _KV, _C, _H)
  k, v = f(_B, _T, _KV, _H), f(_B, _T, _KV, _H)
  tree = jnp.asarray(rng.random((_B, _T, _T)) < 0.4) | jnp.eye(_T, dtype=bool)[None]
  return q, k_cache, v_cache, k, v, tree


@pytest.mark.parametrize("masked", [False, True])
def test_blockwise_equals_dense_attention(masked):
  q, k_cache, v_cache, k, v, tree = _inputs(int(masked))
  starts = jnp.asarray([0, 5, 18])
  block_mask = tree if masked else None
  blockwise = jax.jit(functools.partial(attention.blockwise_attention, query_block=4,
                                        key_block=6))

  # Written: the new tokens sit in the cache at starts + t.
  kw, vw = kv_lib.write_kv(k_cache, v_cache, k, v, starts)
  mask = kv_lib.attention_mask(starts=starts, num_new=_T, capacity=_C, block_mask=block_mask)
  want = attention.cached_attention(q, kw, vw, mask)
  got = blockwise(q, k_cache=kw, v_cache=vw, starts=starts, block_mask=block_mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)

  # Read-only: the cache past `starts` is stale, the new tokens come apart.
  new_mask = block_mask if masked else jnp.broadcast_to(jnp.tril(jnp.ones((_T, _T), bool)),
                                                        (_B, _T, _T))
  want = attention.attention_with_new(
      q, k, v, k_cache=k_cache, v_cache=v_cache,
      cache_mask=kv_lib.committed_mask(starts=starts, capacity=_C), new_mask=new_mask)
  got = blockwise(q, k_cache=k_cache, v_cache=v_cache, starts=starts, block_mask=block_mask,
                  new_kv=(k, v))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


@pytest.fixture
def small_blocks(monkeypatch):
  """Forwards over more than 4 tokens take the long-input paths, in small blocks and chunks."""
  monkeypatch.setattr(attention, "BLOCKWISE_MIN_QUERIES", 4)
  monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
  monkeypatch.setattr(attention, "KEY_BLOCK", 7)
  monkeypatch.setattr(transformer, "PREFILL_CHUNK", 10)


def _prefill(model, tokens, *, capacity, starts=None, **kw):
  b, t = tokens.shape
  cache = model.init_cache(batch_size=b, capacity=capacity)
  if starts is not None:
    cache = cache.with_lengths(starts)
  positions = cache.lengths[:, None] + jnp.arange(t)[None]
  return model(tokens, positions=positions, cache=cache, **kw)


def _close(a, b):
  """Equal up to f32 summation order (the tiny target's logits are in the tens)."""
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


def test_long_forwards_equal_the_dense_forward(tiny, monkeypatch):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, tiny.config.vocab_size, (2, 37)), jnp.int32)
  dense = _prefill(tiny, tokens, capacity=40, taps=(0, 1))
  with monkeypatch.context() as m:
    m.setattr(attention, "BLOCKWISE_MIN_QUERIES", 4)
    m.setattr(attention, "QUERY_BLOCK", 5)
    m.setattr(attention, "KEY_BLOCK", 7)
    blockwise = _prefill(tiny, tokens, capacity=40, taps=(0, 1))  # one piece
    m.setattr(transformer, "PREFILL_CHUNK", 10)
    chunked = _prefill(tiny, tokens, capacity=40, taps=(0, 1))  # 4 chunks, the last moved back
    # Rows of 23 and 15 real tokens: chunks 0-2 run, the padding's chunk does not.
    skipped = _prefill(tiny, tokens, capacity=40, taps=(0, 1), num_valid=jnp.asarray([23, 15]))
  for long in (blockwise, chunked):
    _close(long.logits, dense.logits)
    _close(long.taps, dense.taps)
    for (k, v), (dk, dv) in zip(long.new_kv, dense.new_kv):
      _close(k, dk)
      _close(v, dv)
    np.testing.assert_array_equal(np.asarray(long.cache.lengths), [37, 37])

  # A decode step after the chunked prefill sees what the dense one wrote.
  step = jnp.asarray([[3], [5]], jnp.int32)
  after = lambda o: tiny(step, positions=jnp.full((2, 1), 37), cache=o.cache).logits
  _close(after(chunked), after(dense))

  # Left-out padding changes nothing up to the longest row's end, and is not computed.
  _close(skipped.logits[:, :23], dense.logits[:, :23])
  _close(skipped.taps[:, :23], dense.taps[:, :23])
  assert not np.asarray(skipped.cache.k[0])[:, 30:].any()  # the last chunk's own slots
  assert not np.asarray(skipped.taps)[:, 30:].any()
  lengths = jnp.asarray([23, 15])
  after = lambda o: tiny(step, positions=lengths[:, None], cache=o.cache.with_lengths(lengths))
  _close(after(skipped).logits, after(dense).logits)


def test_read_only_long_forward_equals_the_written_one(tiny, small_blocks):
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, tiny.config.vocab_size, (2, 9)), jnp.int32)
  starts = jnp.asarray([4, 11])
  cache = _prefill(tiny, jnp.asarray(rng.integers(0, 64, (2, 11)), jnp.int32), capacity=24).cache
  cache = cache.with_lengths(starts)
  positions = starts[:, None] + jnp.arange(9)[None]
  written = tiny(tokens, positions=positions, cache=cache)
  read = tiny(tokens, positions=positions, cache=cache, write_cache=False)
  _close(read.logits, written.logits)


def test_dot_product_prefill_equals_xla(tiny, small_blocks):
  """`attention_impl="dot_product"` (the CPU twin of "cudnn") on a prefill."""
  twin = Transformer.from_params(tiny.config, tiny.flat_params(), attention_impl="dot_product")
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 12)), jnp.int32)
  _close(_prefill(twin, tokens, capacity=12).logits, _prefill(tiny, tokens, capacity=12).logits)
  with pytest.raises(ValueError, match="attention_impl"):
    Transformer(tiny.config, attention_impl="flash")


def test_bf16_cache_read_only_and_written_forwards_agree(tiny):
  model = Transformer.from_params(tiny.config, tiny.flat_params(), cache_dtype=jnp.bfloat16)
  rng = np.random.default_rng(3)
  cache = _prefill(model, jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32), capacity=12).cache
  assert cache.k[0].dtype == jnp.bfloat16
  tokens = jnp.asarray(rng.integers(0, 64, (2, 3)), jnp.int32)
  positions = jnp.full((2, 1), 6) + jnp.arange(3)[None]
  written = model(tokens, positions=positions, cache=cache)
  read = model(tokens, positions=positions, cache=cache, write_cache=False)
  # To f32 precision: the new keys / values are rounded to bf16 in both, not in one only.
  _close(read.logits, written.logits)
  assert model.init_cache(batch_size=1, capacity=4, dtype=jnp.float32).k[0].dtype == jnp.float32


@pytest.fixture
def decode_blocks(monkeypatch):
  """`bounded_attention` reads caches in blocks of 8 slots."""
  monkeypatch.setattr(attention, "DECODE_KEY_BLOCK", 8)
  monkeypatch.setattr(attention, "MIN_DECODE_KEY_BLOCK", 1)


def _cache_inputs(seed: int, *, capacity: int, num_new: int = 5, dtype=jnp.float32,
                  head_dim: int = _H):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q = f(_B, num_new, _KV * _G, head_dim)
  k_cache, v_cache = f(_B * _KV, capacity, head_dim), f(_B * _KV, capacity, head_dim)
  k, v = f(_B, num_new, _KV, head_dim), f(_B, num_new, _KV, head_dim)
  tree = (jnp.asarray(rng.random((_B, num_new, num_new)) < 0.4)
          | jnp.eye(num_new, dtype=bool)[None])
  return q, k_cache, v_cache, k, v, tree


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_bounded_attention_equals_the_dense_one(decode_blocks, masked, dtype):
  """Written and read-only, causal and tree, rows at ragged starts (one at 0, one in the last
  block), f32 and bf16: `bounded_attention` computes the dense forms' function."""
  q, k_cache, v_cache, k, v, tree = _cache_inputs(int(masked), capacity=40, dtype=dtype)
  starts = jnp.asarray([0, 9, 35])
  block_mask = tree if masked else None
  bounded = jax.jit(attention.bounded_attention)
  tol = 2e-6 if dtype == jnp.float32 else 2e-2  # bf16: p rounded per block, not per row

  kw, vw = kv_lib.write_kv(k_cache, v_cache, k, v, starts)
  mask = kv_lib.attention_mask(starts=starts, num_new=5, capacity=40, block_mask=block_mask)
  want = attention.cached_attention(q, kw, vw, mask)
  got = bounded(q, k_cache=kw, v_cache=vw, starts=starts, block_mask=block_mask)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)

  new_mask = block_mask if masked else jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)),
                                                        (_B, 5, 5))
  want = attention.attention_with_new(
      q, k, v, k_cache=k_cache, v_cache=v_cache,
      cache_mask=kv_lib.committed_mask(starts=starts, capacity=40), new_mask=new_mask)
  got = bounded(q, k_cache=k_cache, v_cache=v_cache, starts=starts, block_mask=block_mask,
                new_kv=(k, v))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)


def test_bounded_attention_of_a_row_ignores_other_rows_and_the_capacity(decode_blocks):
  """The blocks past a row's end add exactly zero: its bits are the same whether another row
  makes the loop run longer, and in a larger cache (whose blocks sit at the same slots)."""
  q, k_cache, v_cache, k, v, _ = _cache_inputs(7, capacity=40)
  bounded = jax.jit(attention.bounded_attention)
  for new_kv in (None, (k, v)):
    short = bounded(q, k_cache=k_cache, v_cache=v_cache, starts=jnp.asarray([3, 4, 2]),
                    new_kv=new_kv)
    long = bounded(q, k_cache=k_cache, v_cache=v_cache, starts=jnp.asarray([3, 33, 2]),
                   new_kv=new_kv)
    pad = ((0, 0), (0, 24), (0, 0))
    wider = bounded(q, k_cache=jnp.pad(k_cache, pad), v_cache=jnp.pad(v_cache, pad),
                    starts=jnp.asarray([3, 4, 2]), new_kv=new_kv)
    for got in (long, wider):
      np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(short)[[0, 2]])
    assert not np.array_equal(np.asarray(long)[1], np.asarray(short)[1])


def test_xla_cpu_keeps_dense_scores_where_they_were_measured_faster():
  from dloop_jax.models import cpu_kernels  # pylint: disable=g-import-not-at-top
  dense = lambda capacity, pairs=3: attention.dense_short_forwards(
      capacity=capacity, pairs=pairs, queries=3)
  with cpu_kernels.use(True):
    assert dense(1024) and dense(2112)  # small; a growing cache's 64-slot steps
    assert not dense(3072) and not dense(8192)
    assert dense(3072, pairs=96)  # slot-major batched decoding
  with cpu_kernels.use(False):  # the standard form: always bounded
    assert not dense(64) and not dense(2112)


def test_decode_key_blocks_divide_the_cache():
  assert attention.decode_key_block(96) == 96  # one block up to DECODE_KEY_BLOCK slots
  assert attention.decode_key_block(3072) == attention.DECODE_KEY_BLOCK
  assert attention.decode_key_block(384) == 128  # 3 * 2^7: the common power of two
  assert attention.decode_key_block(2 * 3 * 5 * 7 * 11) == 2 * 3 * 5 * 7 * 11  # none: one block


@pytest.mark.parametrize("masked", [False, True])
def test_gpu_decode_kernel_in_interpret_mode_equals_the_xla_loop(masked):
  """Pallas GPU flash decoding (interpret mode) for the committed slots, merged with the new
  tokens' chain or tree block: GQA (3 query heads a kv head), ragged lengths, bf16; and a
  one-token written step, the kernel alone."""
  capacity, head = 64, 16  # the kernel splits the cache into 4 parts of one 16-slot block
  q, k_cache, v_cache, k, v, tree = _cache_inputs(11 + masked, capacity=capacity,
                                                  dtype=jnp.bfloat16, head_dim=head)
  starts = jnp.asarray([0, 17, 59])
  block_mask = tree if masked else None
  assert attention_kernels.gpu_supports(capacity=capacity, head_dim=head)

  def run(kernel, q, k_cache, v_cache, new_kv):
    fn = functools.partial(attention.bounded_attention, starts=starts, block_mask=block_mask,
                           new_kv=new_kv, kernel=kernel)
    with attention_kernels.recording() as called:
      jaxpr = str(jax.make_jaxpr(lambda q, kc, vc: fn(q, k_cache=kc, v_cache=vc))(
          q, k_cache, v_cache))
    assert ("pallas_call" in jaxpr) == (kernel is not None)
    assert called == ({"pallas_gpu_interpret"} if kernel else set())  # what the program holds
    return np.asarray(jax.jit(lambda q, kc, vc: fn(q, k_cache=kc, v_cache=vc))(
        q, k_cache, v_cache), np.float32)

  # bf16 operands: the kernel rounds its normalized output to bf16, the XLA loop does not.
  read_only = [run(kernel, q, k_cache, v_cache, (k, v)) for kernel in ("gpu_interpret", None)]
  np.testing.assert_allclose(*read_only, atol=2e-2)
  one = q[:, :1]
  kw, vw = kv_lib.write_kv(k_cache, v_cache, k[:, :1], v[:, :1], starts)
  written = [run(kernel, one, kw, vw, None) for kernel in ("gpu_interpret", None)]
  np.testing.assert_allclose(*written, atol=2e-2)


def test_tpu_paged_kernel_in_interpret_mode_equals_the_xla_loop():
  """Pallas TPU paged attention (interpret mode) of a one-token written step: GQA, ragged
  lengths (one row in the last page), bf16."""
  capacity, head = 64, 16
  q, k_cache, v_cache, k, v, _ = _cache_inputs(13, capacity=capacity, num_new=1,
                                               dtype=jnp.bfloat16, head_dim=head)
  starts = jnp.asarray([0, 17, 63])
  kw, vw = kv_lib.write_kv(k_cache, v_cache, k, v, starts)
  assert attention_kernels.tpu_supports(capacity=capacity)
  got = {}
  for kernel in ("tpu_interpret", None):
    fn = lambda q, kc, vc, kernel=kernel: attention.bounded_attention(
        q, k_cache=kc, v_cache=vc, starts=starts, kernel=kernel)
    with attention_kernels.recording() as called:
      jaxpr = str(jax.make_jaxpr(fn)(q, kw, vw))
    assert ("pallas_call" in jaxpr) == (kernel is not None)
    assert called == ({"pallas_tpu_interpret"} if kernel else set())  # what the program holds
    got[kernel] = np.asarray(jax.jit(fn)(q, kw, vw), np.float32)
  np.testing.assert_allclose(got["tpu_interpret"], got[None], atol=2e-2)


def test_kernels_fall_back_to_the_xla_forms_off_their_device(monkeypatch):
  monkeypatch.delenv("DLOOP_INTERPRET_KERNELS", raising=False)
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert attention_kernels.prefill_impl("cudnn", bf16) == "xla"  # this CPU: no cuDNN
  assert attention_kernels.decode_kernel("cudnn", bf16) is None
  assert attention_kernels.decode_kernel("pallas_tpu", bf16) is None
  with attention_kernels.interpret():
    assert attention_kernels.prefill_impl("cudnn", bf16) == "dot_product"
    assert attention_kernels.prefill_impl("cudnn", f32) == "xla"  # 16-bit operands only
    # The tpu profile prefills with the XLA forms (blockwise, chunked for long prompts) on
    # every backend: no dense T x T scores.
    assert attention_kernels.prefill_impl("pallas_tpu", bf16) == "xla"
    assert attention_kernels.decode_kernel("cudnn", bf16) == "gpu_interpret"
    assert attention_kernels.decode_kernel("pallas_tpu", bf16) == "tpu_interpret"
    assert attention_kernels.decode_kernel("cudnn", f32) is None
    assert attention_kernels.decode_kernel("xla", bf16) is None
  monkeypatch.setenv("DLOOP_INTERPRET_KERNELS", "1")
  assert attention_kernels.decode_kernel("cudnn", bf16) == "gpu_interpret"
  assert not attention_kernels.gpu_supports(capacity=64, head_dim=8)  # Triton: 16 at least
  assert not attention_kernels.gpu_supports(capacity=24, head_dim=64)  # no 16-slot blocks
  assert attention_kernels._gpu_blocks(96) == (16, 2)  # noqa: SLF001
  assert attention_kernels._gpu_blocks(49152) == (128, 16)  # noqa: SLF001
