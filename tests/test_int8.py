"""Int8 weight matrices (`weights="int8"`): quantization, both product forms, the compiled
programs, loading, and greedy / sampling exactness against plain decoding of the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import drafter_fixtures
import model_fixtures
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.models import cpu_kernels, int8, int8_hlo, load_target
from dloop_jax.models.transformer import LAYER_MATRICES, Transformer, tiny_target
from reference import chi_square_pvalue, exact_distribution


def _int8_of(model: Transformer, **kw) -> Transformer:
  return Transformer.from_params(model.config, model.flat_params(), weight_dtype=jnp.int8, **kw)


@pytest.fixture(scope="module")
def tiny_int8(tiny):
  return _int8_of(tiny)


def _rng_matrix(seed, shape, scale=0.1):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


def test_quantize_per_output_channel():
  w = _rng_matrix(0, (96, 40))
  w[:, 3] = 0.0  # an all-zero channel
  values, scale = int8.quantize(w, axis=0)
  assert values.dtype == np.int8 and scale.shape == (40,) and scale.dtype == np.float32
  # Each channel spans the symmetric range: its largest magnitude is code 127.
  peaks = np.abs(values.astype(np.int32)).max(axis=0)
  assert (peaks[np.arange(40) != 3] == 127).all() and peaks[3] == 0 and scale[3] == 1.0
  back = int8.dequantize(values, scale, axis=0)
  assert (np.abs(back - w) <= scale / 2 * (1 + 1e-6)).all()  # within half a step
  # The tied head's layout [V, D] contracts axis 1: one scale per row.
  rows, row_scale = int8.quantize(w.T, axis=1)
  np.testing.assert_array_equal(rows, values.T)
  np.testing.assert_array_equal(row_scale, scale)


@pytest.mark.parametrize("contract", [0, 1])
def test_cpu_form_is_integer_arithmetic_and_a_row_gets_the_same_bits_among_others(contract):
  w = _rng_matrix(1, (96, 40) if contract == 0 else (40, 96))
  values, scale = int8.quantize(w, axis=contract)
  x = _rng_matrix(2, (5, 96), scale=1.0)

  @jax.jit
  def product(x):
    with cpu_kernels.use(True):
      return int8.product(x, jnp.asarray(values), jnp.asarray(scale), contract=contract)

  got = np.asarray(product(x))
  # The reference: the same per-row codes, an exact integer product, the two scales.
  peak = np.abs(x).max(axis=1, keepdims=True)
  codes = np.clip(np.round(x / (peak / 127)), -127, 127).astype(np.int64)
  acc = codes @ (values.astype(np.int64) if contract == 0 else values.astype(np.int64).T)
  want = acc * (peak / 127) * scale[None, :]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # A single row (padded to two) is that row of a wider product, bit for bit.
  for i in (0, 4):
    np.testing.assert_array_equal(np.asarray(product(x[i:i + 1]))[0], got[i])
  # And the product approximates the float one to int8 rounding of both operands.
  exact = x.astype(np.float64) @ (w if contract == 0 else w.T)
  assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_standard_form_matches_dequantize_then_dot(dtype):
  w = _rng_matrix(3, (96, 40))
  values, scale = int8.quantize(w, axis=0)
  x = jnp.asarray(_rng_matrix(4, (1, 3, 96), scale=1.0), dtype)

  @jax.jit
  def product(x):
    with cpu_kernels.use(False):
      return int8.product(x, jnp.asarray(values), jnp.asarray(scale), contract=0)

  got = np.asarray(product(x))
  assert got.shape == (1, 3, 40) and got.dtype == np.float32
  dequantized = int8.dequantize(values, scale, axis=0).astype(np.float64)
  want = np.asarray(x, np.float64) @ dequantized
  # f32 accumulation of exact products: differences are rounding only.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_forward_multiplies_the_int8_weights_as_they_are_stored(tied):
  """XLA:CPU's compiled forward reads every int8 matrix in an integer product (YNNPACK),
  tied head included: no float copy of a weight, at one token (padded to two) and at five."""
  model = _int8_of(tiny_target(seed=1, tie_embeddings=tied, vocab_size=256))
  graph, state = nnx.split(model)
  cache = model.init_cache(batch_size=1, capacity=16)

  @jax.jit
  def forward(state, tokens, cache):
    m = nnx.merge(graph, state)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    return m(tokens, positions=positions, cache=cache).logits

  c = model.config
  smallest = min(c.hidden_size * (c.q_size + 2 * c.kv_size), c.q_size * c.hidden_size,
                 c.intermediate_size * c.hidden_size)
  for width in (1, 5):
    hlo = forward.lower(state, jnp.ones((1, width), jnp.int32), cache).compile().as_text()
    reads = int8_hlo.weight_reads(hlo, min_elements=smallest)
    assert reads.products == len(LAYER_MATRICES) * c.num_layers + 1, (width, reads)
    assert not reads.whole, (width, reads.whole)


def test_standard_form_converts_the_weights_inside_the_product_where_xla_cpu_can_fuse():
  """The standard (GPU / TPU) form is convert -> dot on the stored int8 weight. XLA:CPU
  fuses that convert into its matrix kernel only under an experimental flag; by default a
  product of two rows writes the float matrix first (why the CPU profile uses the integer
  form). On GPUs / TPUs the fusion is the compiler's default, shown on a device only."""
  script = textwrap.dedent(f"""
      import json, jax, jax.numpy as jnp
      from dloop_jax.models import cpu_kernels, int8
      def product(x, w, s):
        with cpu_kernels.use(False):
          return int8.product(x, w, s, contract=0)
      args = {_STANDARD_ARGS}
      print(json.dumps(jax.jit(product).lower(*args).compile().as_text()))
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise")
  run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  fused = json.loads(run.stdout.strip().splitlines()[-1])
  reads = int8_hlo.weight_reads(fused, min_elements=256 * 512)
  assert reads.products == 1 and not reads.whole, reads
  # This process, without the flag: f32[256,512] written first (if that changes, revisit).
  reads = int8_hlo.weight_reads(_standard_product_hlo(), min_elements=256 * 512)
  assert reads.products == 0 and reads.whole, reads


_STANDARD_ARGS = ("(jnp.ones((2, 256), jnp.float32), jnp.ones((256, 512), jnp.int8),"
                  " jnp.ones((512,), jnp.float32))")


def _standard_product_hlo() -> str:
  def product(x, w, s):
    with cpu_kernels.use(False):
      return int8.product(x, w, s, contract=0)
  return jax.jit(product).lower(*eval(_STANDARD_ARGS)).compile().as_text()


def test_int8_state_and_round_trip(tiny, tiny_int8):
  layer = tiny_int8.layers[0]
  for name in LAYER_MATRICES:
    assert getattr(layer, name)[...].dtype == jnp.int8
    assert getattr(layer, name + "_scale")[...].shape == (getattr(layer, name)[...].shape[1],)
  assert tiny_int8.embed[...].dtype == jnp.int8 and not tiny_int8.out_major
  assert layer.attn_norm[...].dtype == jnp.float32
  # flat_params dequantizes; loading that again gives the same int8 state.
  again = _int8_of(tiny_int8)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(tiny_int8)),
                               jax.tree_util.tree_leaves_with_path(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  # A randomly initialised int8 target is the f32 one, quantized.
  rand8, rand32 = Transformer(tiny.config, weight_dtype=jnp.int8), Transformer(tiny.config)
  np.testing.assert_array_equal(np.asarray(rand8.layers[1].w_down[...]),
                                int8.quantize(np.asarray(rand32.layers[1].w_down[...]), axis=0)[0])


def test_load_target_with_int8_weights(tmp_path):
  # A GGUF, the registry's format (a Hugging Face directory takes the same `from_params`).
  hf = model_fixtures.tiny_hf_model("qwen2_untied")
  path = model_fixtures.write_gguf(hf, str(tmp_path / "tiny.gguf"))
  f32 = load_target(path, dtype="float32").model
  q = load_target(path, weights="int8").model
  assert q.int8 and q.dtype == jnp.float32 and q.layers[0].bqkv[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(q.lm_head[...]),
                                int8.quantize(np.asarray(f32.lm_head[...]), axis=0)[0])
  tokens = np.random.default_rng(0).integers(0, 128, (1, 12))
  ref = model_fixtures.flax_logits(f32, tokens)
  got = model_fixtures.flax_logits(q, tokens)
  # Weights and activations rounded to 8 bits: close, not equal.
  assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
  assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_sampling_keeps_the_int8_targets_distribution(tiny_int8):
  """dloop samples the int8 model's own distribution (greedy: tests/test_lossless_matrix.py)."""
  sampling = SamplingConfig(temperature=1.0, top_k=4)
  prompt = [3, 14, 15]
  exact = exact_distribution(tiny_int8, prompt, sampling)
  drafter = drafter_fixtures.perturbed(tiny_int8, noise_scale=2.0, seed=5)
  out = generate(tiny_int8, [prompt] * 4_000, max_new_tokens=3, mode="dloop", sampling=sampling,
                 drafter=drafter, block_size=2, max_stages=2, gate=-0.5, seed=11)
  assert out.total.drafted > 0
  pvalue, stat = chi_square_pvalue([tuple(t) for t in out.tokens], exact)
  assert pvalue > 1e-4, f"chi-square {stat:.1f}, p = {pvalue:.2e}"


def test_parts_benchmark_times_each_part_of_both_storages(tiny, tiny_int8, monkeypatch, capsys):
  """`python -m infer.bench.int8_parts` on the tiny target: a row per part and width, the
  weight bytes each storage streams (int8: a byte a weight and an f32 scale a channel)."""
  from dloop_jax.models import registry  # pylint: disable=g-import-not-at-top
  from infer.bench import int8_parts  # pylint: disable=g-import-not-at-top
  models = {"f32": tiny, "int8": tiny_int8}
  monkeypatch.setattr(registry, "load_target", lambda source, *, weights: registry.LoadedTarget(
      model=models[weights], config=tiny.config, tokenizer=None, source=source, name="tiny"))
  assert int8_parts.main(["--tokens", "1,3", "--repeats", "2"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| T=")]
  assert [r.split("|")[1].strip() for r in rows] == [
      f"T={t}: {part}" for t in (1, 3) for part in ("products", "head", "rest", "forward")]
  f32, int8_bytes = (int8_parts._weight_bytes(m) for m in (tiny, tiny_int8))  # pylint: disable=protected-access
  c = tiny.config
  scales = c.num_layers * (c.q_size + 2 * c.kv_size + c.hidden_size + 2 * c.intermediate_size
                           + c.hidden_size)
  assert int8_bytes["products"] == f32["products"] // 4 + 4 * scales
  assert int8_parts.main(["--tokens", "0"]) == 2
