"""Weight storage (`weights="bf16"`): products, loading, and greedy losslessness."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drafter_fixtures
import model_fixtures
from dloop_jax.decoding import generate
from dloop_jax.errors import ConfigError
from dloop_jax.models import load_target
from dloop_jax.models.registry import weight_dtype
from dloop_jax.models.transformer import (LAYER_MATRICES, MATRIX_WEIGHTS, Transformer, dense,
                                          dense_out_major, param_shapes, project_rows, take_rows)
from lossless import assert_same_or_near_tie


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
  return Transformer.from_params(tiny.config, tiny.flat_params(), weight_dtype=jnp.bfloat16)


def test_single_row_product_equals_its_row_in_a_wider_product():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((96, 160)) * 0.1, jnp.bfloat16)
  rows = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
  one = jax.jit(dense)(rows[:1], w)
  five = jax.jit(dense)(rows, w)
  assert one.dtype == jnp.float32 and one.shape == (1, 160)
  np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(five[0]))
  # bf16 operands, f32 accumulation: close to the f32 product.
  exact = np.asarray(rows, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(np.asarray(five), exact, rtol=0, atol=0.05)
  head = jnp.asarray(rng.standard_normal((200, 96)) * 0.1, jnp.bfloat16)  # tied head [V, D]
  np.testing.assert_array_equal(np.asarray(jax.jit(project_rows)(rows[:1], head)[0]),
                                np.asarray(jax.jit(project_rows)(rows, head)[0]))


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 64, 600])
def test_out_major_product_gives_a_row_the_bits_it_has_among_others(rows):
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((160, 96)) * 0.1, jnp.bfloat16)  # [N, K]
  x = jnp.asarray(rng.standard_normal((600, 96)), jnp.float32)
  got = jax.jit(dense_out_major)(x[:rows].reshape(1, rows, 96), w)
  assert got.shape == (1, rows, 160) and got.dtype == jnp.float32
  exact = np.asarray(x[:rows], np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
  np.testing.assert_allclose(np.asarray(got[0]), exact, rtol=0, atol=0.05)
  if rows <= 64:  # up to HALF_WEIGHTS_LEFT_MAX_ROWS: the same kernel
    np.testing.assert_array_equal(np.asarray(got[0, 0]),
                                  np.asarray(jax.jit(dense_out_major)(x[:2], w)[0]))


def test_bf16_layers_hold_matrices_out_major(tiny, tiny_bf16):
  assert tiny_bf16.out_major and not tiny.out_major
  shapes = param_shapes(tiny.config)
  for name in LAYER_MATRICES:
    k, n = shapes[f"layers.{name}"][1:]
    assert getattr(tiny_bf16.layers[0], name)[...].shape == (n, k)
    assert getattr(tiny.layers[0], name)[...].shape == (k, n)
  # Files and loaders see the [K, N] layout: the flat parameters round-trip.
  params = tiny_bf16.flat_params()
  assert {k: v.shape for k, v in params.items()} == shapes
  again = Transformer.from_params(tiny.config, params, weight_dtype=jnp.bfloat16).flat_params()
  for name, value in params.items():
    np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(value))
  # A randomly initialised bf16 target is the f32 one, rounded.
  rand16 = Transformer(tiny.config, weight_dtype=jnp.bfloat16).flat_params()
  rand32 = Transformer(tiny.config).flat_params()
  for name in ("layers.wqkv", "layers.w_down"):
    np.testing.assert_array_equal(rand16[name], np.asarray(rand32[name], rand16[name].dtype))


def _dot_lhs_shapes(jaxpr) -> list[tuple[int, ...]]:
  """Left operand shapes of every dot_general, nested jaxprs (custom_vjp) included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      shapes.append(tuple(eqn.invars[0].aval.shape))
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        shapes += _dot_lhs_shapes(inner)
  return shapes


def test_single_row_product_is_padded_to_two_rows():
  w = jnp.zeros((8, 4), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(dense)(jnp.zeros((1, 1, 8), jnp.float32), w)
  assert _dot_lhs_shapes(jaxpr.jaxpr) == [(2, 8)]
  f32 = jax.make_jaxpr(dense)(jnp.zeros((1, 1, 8), jnp.float32), w.astype(jnp.float32))
  assert _dot_lhs_shapes(f32.jaxpr) == [(1, 1, 8)]


def test_bf16_weights_store_matrices_in_bf16_and_the_rest_in_f32(tiny, tiny_bf16):
  params = tiny_bf16.flat_params()
  for name, value in params.items():
    want = jnp.bfloat16 if name in MATRIX_WEIGHTS else jnp.float32
    assert value.dtype == want, name
  tokens = jnp.asarray([[3, 5, 7, 11]], jnp.int32)
  positions = jnp.arange(4)[None]

  def logits(model):
    cache = model.init_cache(batch_size=1, capacity=8)
    return np.asarray(model(tokens, positions=positions, cache=cache).logits)

  ref, got = logits(tiny), logits(tiny_bf16)
  assert got.dtype == np.float32
  # Same model up to bf16 rounding of weights and activations.
  assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))
  assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_weight_dtype_names_and_errors():
  assert weight_dtype("bf16") == jnp.bfloat16
  assert weight_dtype("F32") == jnp.float32
  assert weight_dtype(None, default=jnp.bfloat16) == jnp.bfloat16
  with pytest.raises(ConfigError, match="weights must be one of"):
    weight_dtype("fp8")
  assert weight_dtype("int8") == weight_dtype(jnp.int8) == jnp.int8
  with pytest.raises(ConfigError, match="float32, bfloat16 or int8"):
    weight_dtype(jnp.int16)


def test_load_target_with_bf16_weights(tmp_path):
  tiny_hf_dir = model_fixtures.save_hf(model_fixtures.tiny_hf_model("llama_tied"),
                                       str(tmp_path / "tiny"))
  f32 = load_target(tiny_hf_dir, dtype="float32")
  bf16 = load_target(tiny_hf_dir, weights="bf16")
  assert f32.model.layers[0].w_down[...].dtype == jnp.float32
  assert bf16.model.layers[0].w_down[...].dtype == jnp.bfloat16
  assert bf16.model.layers[0].attn_norm[...].dtype == jnp.float32
  np.testing.assert_array_equal(
      np.asarray(bf16.model.embed[...]), np.asarray(f32.model.embed[...]).astype(jnp.bfloat16))


@pytest.mark.parametrize("gamma,max_stages,batch", [(3, 1, 1), (2, 3, 3)])
def test_greedy_lossless_with_bf16_weights(tiny_bf16, gamma, max_stages, batch):
  """By default every mode runs at one width: the same tokens as ar with the same options."""
  drafter = drafter_fixtures.perturbed(tiny_bf16, noise_scale=1.0, seed=3)
  rng = np.random.default_rng(gamma * 10 + max_stages + batch)
  for _ in range(2):
    prompts = [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(batch)]
    ar = generate(tiny_bf16, prompts, max_new_tokens=20, block_size=gamma, max_stages=max_stages)
    for mode, gate in [("sd", -0.5), ("dloop", -0.5), ("dloop", -math.inf)]:
      if mode == "sd" and max_stages > 1:
        continue  # sd verifies one stage: ar's options would differ
      out = generate(tiny_bf16, prompts, max_new_tokens=20, mode=mode, drafter=drafter,
                     block_size=gamma, gate=gate, max_stages=max_stages)
      assert out.fixed_width == ar.fixed_width == max(5, 1 + max_stages * gamma)
      assert out.tokens == ar.tokens, (mode, gate)
    # Free widths: refused unless asked for, then within 16-bit rounding.
    with pytest.raises(ConfigError, match="would not reproduce mode 'ar' exactly"):
      generate(tiny_bf16, prompts, max_new_tokens=20, mode="dloop", drafter=drafter,
               block_size=gamma, max_stages=max_stages, schedule="cost")
    free_ar = generate(tiny_bf16, prompts, max_new_tokens=20, fixed_width=0)
    out = generate(tiny_bf16, prompts, max_new_tokens=20, mode="dloop", drafter=drafter,
                   block_size=gamma, max_stages=max_stages, schedule="cost",
                   allow_inexact=True)
    assert out.fixed_width is None
    for p, want, got in zip(prompts, free_ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny_bf16, p, want, got)


@pytest.mark.parametrize("take", ["take_rows", "jnp.take"])
def test_a_bf16_table_is_not_converted_whole_to_gather_rows_in_a_loop(take):
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.standard_normal((512, 48)), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(0, 512, (6,)), jnp.int32)
  gather = take_rows if take == "take_rows" else (lambda t, i: jnp.take(t, i, axis=0))

  def rows(table, ids):  # a decode loop: one row per step
    def step(carry, i):
      return carry, gather(table, i[None]).astype(jnp.float32)[0]
    return jax.lax.scan(step, 0.0, ids)[1]

  program = jax.jit(rows).lower(table, ids).compile()
  np.testing.assert_array_equal(np.asarray(program(table, ids)),
                                np.asarray(table, np.float32)[np.asarray(ids)])
  # A whole-table f32 / u16 array outside fusion bodies: a buffer of its own
  # (inside a fusion, a converted operand is computed only where the gather reads).
  whole, in_fusion_body = [], False
  for line in program.as_text().splitlines():
    if line and not line.startswith(" "):  # a computation's header
      in_fusion_body = "_computation" in line.split("(")[0]
    elif not in_fusion_body and re.search(r"= (f32|u16)\[512,48\]\{[0-9,]*\} \S+\(", line):
      if not re.search(r"(parameter|get-tuple-element)\(", line):
        whole.append(line.strip())
  if take == "take_rows":
    assert not whole, whole[:3]
  else:  # what take_rows avoids (if XLA stops doing it, take_rows can go)
    assert whole
