"""KV-cache decoding equals one forward over the whole sequence.

A property over tiny random targets (Llama with Llama-3 RoPE scaling, Qwen2 with
q/k/v biases, Qwen3 with per-head q/k norms, and the default tiny target),
batch sizes and per-row lengths: prefill a per-row prefix (the padding past it
holds junk tokens), then feed the rest one token at a time, several at a time,
or several at a time with only a random prefix of them accepted and the rest
rolled back by setting the row's length, as speculative verification does.
The logits at every position and the keys / values in every committed slot
must equal those of a single forward over the whole sequence with an empty
cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model_fixtures
from dloop_jax.models import attention
from dloop_jax.models.hf_loader import load_hf_dir
from dloop_jax.models.kv_cache import write_kv
from dloop_jax.models.transformer import Transformer

# f32 rounding only: a forward over 1, 4 or 24 new tokens sums attention and
# matmuls in different orders (logits of these targets reach |5|).
TOL = 3e-5
WIDTH = 24  # longest row
CHUNK = 4  # tokens per forward when feeding several
PREFILL = CHUNK  # padded prefill width (the same shape: one compile fewer)
CAPACITY = 32  # WIDTH + CHUNK fit: no chunk runs past the last slot
HF_KINDS = ("llama_untied_llama3_rope", "qwen2_untied", "qwen3_tied")
KINDS = ("tiny",) + HF_KINDS
SCHEDULES = ("one", "several", "rollback")
# (batch size, seed) of the random cases drawn for every model and schedule.
CASES = ((3, 0), (1, 1), (3, 2))


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
  """Our transformer for each kind; the HF kinds carry random weights with norms != 1."""
  out = {"tiny": tiny}
  for kind in HF_KINDS:
    path = model_fixtures.save_hf(model_fixtures.tiny_hf_model(kind, seed=7),
                                  str(tmp_path_factory.mktemp("hf") / kind))
    config, params = load_hf_dir(path)
    out[kind] = Transformer.from_params(config, params)
  return out


@functools.cache
def _jit_forward(model: Transformer):
  """(tokens, positions, cache) -> (logits, cache), jit-compiled once per shape."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, positions, cache):
    out = nnx.merge(graphdef, state)(tokens, positions=positions, cache=cache)
    return out.logits, out.cache

  def forward(tokens, positions, cache):
    return run(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache)

  return forward


def _full_forward(model, tokens):
  """Logits [B, T, V] and cache of one forward over all tokens, from an empty cache."""
  b, t = tokens.shape
  positions = np.broadcast_to(np.arange(t), (b, t))
  logits, cache = _jit_forward(model)(tokens, positions,
                                      model.init_cache(batch_size=b, capacity=t))
  return np.asarray(logits), cache


def _cached_decode(model, tokens, lengths, prefix, schedule, rng):
  """Logits [B, WIDTH, V] of a prefill then incremental feeding, and the final cache.

  schedule: "one" (a token per forward), "several" (CHUNK per forward, all
  accepted) or "rollback" (1 or CHUNK per forward, a random non-empty prefix
  accepted, the rest rolled back; the stale slots stay behind the new length).
  """
  forward = _jit_forward(model)
  b, vocab = len(lengths), model.config.vocab_size
  got = np.full((b, WIDTH, vocab), np.nan, np.float32)
  cache = model.init_cache(batch_size=b, capacity=CAPACITY)
  junk = rng.integers(0, vocab, size=(b, PREFILL))
  first = np.where(np.arange(PREFILL) < prefix[:, None], tokens[:, :PREFILL], junk)
  logits, cache = forward(first, np.broadcast_to(np.arange(PREFILL), (b, PREFILL)), cache)
  logits = np.asarray(logits)
  for r in range(b):
    got[r, :prefix[r]] = logits[r, :prefix[r]]
  starts = prefix.copy()
  cache = cache.with_lengths(jnp.asarray(starts))
  while np.any(starts < lengths):
    width = {"one": 1, "several": CHUNK, "rollback": int(rng.choice([1, CHUNK]))}[schedule]
    fed = rng.integers(0, vocab, size=(b, width))  # junk wherever nothing is accepted
    accepted = np.zeros(b, np.int64)
    for r in range(b):
      left = lengths[r] - starts[r]
      if left > 0:
        n = min(width, left)
        accepted[r] = rng.integers(1, n + 1) if schedule == "rollback" else n
        fed[r, :accepted[r]] = tokens[r, starts[r]:starts[r] + accepted[r]]
    logits, cache = forward(fed, starts[:, None] + np.arange(width), cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), starts + width)
    logits = np.asarray(logits)
    for r in range(b):
      got[r, starts[r]:starts[r] + accepted[r]] = logits[r, :accepted[r]]
    starts = starts + accepted
    cache = cache.with_lengths(jnp.asarray(starts))
  return got, cache


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_equals_full_forward(models, kind, schedule):
  """Prefill + incremental decode (with rollbacks) reproduce a full forward to 1e-5."""
  model = models[kind]
  vocab = model.config.vocab_size
  for batch, seed in CASES:
    rng = np.random.default_rng([seed, KINDS.index(kind), SCHEDULES.index(schedule)])
    tokens = rng.integers(0, vocab, size=(batch, WIDTH))
    lengths = rng.integers(2, WIDTH + 1, size=batch)
    lengths[rng.integers(batch)] = WIDTH  # one row fills the whole width
    prefix = np.array([rng.integers(1, min(PREFILL, n - 1) + 1) for n in lengths])
    want, full_cache = _full_forward(model, tokens)
    got, cache = _cached_decode(model, tokens, lengths, prefix, schedule, rng)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for r in range(batch):
      n = lengths[r]
      where = f"{kind} {schedule} batch {batch} seed {seed} row {r} (length {n}, prefix {prefix[r]})"
      np.testing.assert_allclose(got[r, :n], want[r, :n], atol=TOL, rtol=0, err_msg=where)
      for layer in range(len(cache.k)):
        for name, cached, full in zip("kv", cache.layer(layer), full_cache.layer(layer)):
          np.testing.assert_allclose(
              np.asarray(cached[r, :n]), np.asarray(full[r, :n]), atol=TOL, rtol=0,
              err_msg=f"cached {name} of layer {layer}: {where}")


def test_rows_do_not_see_each_other(models):
  """A row's logits do not depend on the other rows of the batch or their lengths."""
  model = models["qwen3_tied"]
  rng = np.random.default_rng(11)
  tokens = rng.integers(0, model.config.vocab_size, size=(3, WIDTH))
  lengths, prefix = np.array([WIDTH, 9, 17]), np.array([3, 4, 1])
  together, _ = _cached_decode(model, tokens, lengths, prefix, "rollback", rng)
  for r in range(3):
    alone, _ = _cached_decode(model, tokens[r:r + 1], lengths[r:r + 1], prefix[r:r + 1],
                              "several", rng)
    n = lengths[r]
    np.testing.assert_allclose(together[r, :n], alone[0, :n], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_forward_then_append_equals_writing_forward(models, kind):
  """`write_cache=False` + `cache.append` (DLoop's multi-width verification) gives the
  logits and cache of the writing forward, causal or with a random block mask."""
  model = models[kind]
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, static_argnames="write")
  def run(state, tokens, positions, cache, block_mask, write):
    out = nnx.merge(graphdef, state)(tokens, positions=positions, cache=cache,
                                     block_mask=block_mask, write_cache=write)
    return out.logits, (out.cache if write else out.cache.append(out.new_kv))

  vocab = model.config.vocab_size
  for batch, seed in CASES:
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    prefix = rng.integers(1, WIDTH - CHUNK, size=batch)
    cache = model.init_cache(batch_size=batch, capacity=CAPACITY)
    first = rng.integers(0, vocab, size=(batch, WIDTH - CHUNK))
    _, cache = run(state, jnp.asarray(first), jnp.broadcast_to(jnp.arange(WIDTH - CHUNK),
                                                               first.shape),
                   cache, None, True)
    cache = cache.with_lengths(jnp.asarray(prefix))  # stale slots behind every row
    tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, CHUNK)))
    positions = jnp.asarray(prefix[:, None] + np.arange(CHUNK))
    random_mask = (rng.random((batch, CHUNK, CHUNK)) < 0.6) | np.eye(CHUNK, dtype=bool)
    masks = (None, jnp.asarray(random_mask))
    for block_mask in masks:
      want_logits, want_cache = run(state, tokens, positions, cache, block_mask, True)
      got_logits, got_cache = run(state, tokens, positions, cache, block_mask, False)
      np.testing.assert_allclose(got_logits, want_logits, atol=TOL, rtol=0)
      np.testing.assert_array_equal(got_cache.lengths, want_cache.lengths)
      for layer in range(len(want_cache.k)):
        for got, want in zip(got_cache.layer(layer), want_cache.layer(layer)):
          for r in range(batch):
            n = prefix[r] + CHUNK
            np.testing.assert_allclose(got[r, :n], want[r, :n], atol=TOL, rtol=0)


@pytest.mark.parametrize("batch", [3, 21])  # straight-line rows, and the row loop
def test_write_kv_puts_each_row_at_its_own_start(batch):
  kv_heads, capacity, new, head = 2, 12, 3, 4
  rng = np.random.default_rng(batch)
  k_cache, v_cache = (rng.normal(size=(batch * kv_heads, capacity, head)).astype(np.float32)
                      for _ in range(2))
  k, v = (rng.normal(size=(batch, new, kv_heads, head)).astype(np.float32) for _ in range(2))
  starts = rng.integers(0, capacity - new + 1, size=batch)
  got_k, got_v = jax.jit(write_kv)(k_cache, v_cache, k, v, jnp.asarray(starts))
  for got, cache, upd in ((got_k, k_cache, k), (got_v, v_cache, v)):
    want = cache.reshape(batch, kv_heads, capacity, head).copy()
    for r in range(batch):
      want[r, :, starts[r]:starts[r] + new] = upd[r].transpose(1, 0, 2)
    np.testing.assert_array_equal(np.asarray(got), want.reshape(cache.shape))


@pytest.mark.parametrize("batch,new", [(12, 1), (12, 3), (2, 1)])
def test_cached_attention_layouts_agree(batch, new, monkeypatch):
  """Slot-major scores (many rows, few queries) equal the query-major ones,
  and both equal a plain softmax attention over the visible slots."""
  kv_heads, groups, capacity, head = 3, 2, 20, 8
  rng = np.random.default_rng(batch * 10 + new)
  q = rng.normal(size=(batch, new, kv_heads * groups, head)).astype(np.float32)
  k_cache, v_cache = (rng.normal(size=(batch * kv_heads, capacity, head)).astype(np.float32)
                      for _ in range(2))
  lengths = rng.integers(1, capacity - new + 1, size=batch)
  # Row r sees slots < lengths[r] + t + 1 at new token t (causal over the new ones).
  mask = np.arange(capacity)[None, None, :] < (lengths[:, None, None]
                                               + np.arange(new)[None, :, None] + 1)
  layouts = {}
  for name, min_pairs in (("slot_major", 1), ("query_major", 10 ** 9)):
    monkeypatch.setattr(attention, "SLOT_MAJOR_MIN_PAIRS", min_pairs)
    assert attention._slot_major(pairs=batch * kv_heads, queries=groups * new) == (
        name == "slot_major")
    layouts[name] = np.asarray(jax.jit(attention.cached_attention)(q, k_cache, v_cache,
                                                                   jnp.asarray(mask)))
  kc = k_cache.reshape(batch, kv_heads, capacity, head)
  vc = v_cache.reshape(batch, kv_heads, capacity, head)
  want = np.zeros((batch, new, kv_heads * groups, head), np.float64)
  for r in range(batch):
    for t in range(new):
      for n in range(kv_heads * groups):
        scores = kc[r, n // groups] @ q[r, t, n] / np.sqrt(head)
        scores = np.where(mask[r, t], scores, -np.inf)
        p = np.exp(scores - scores.max())
        want[r, t, n] = (p / p.sum()) @ vc[r, n // groups]
  want = want.reshape(batch, new, -1)
  np.testing.assert_allclose(layouts["slot_major"], want, atol=1e-5)
  np.testing.assert_allclose(layouts["query_major"], want, atol=1e-5)
