"""The lossless contract across options: every drafter kind, precision, width policy and batch.

For each combination `generate()` accepts, greedy `sd` / `dloop` output equals
`ar` output with the same options: bit for bit at a fixed width (16-bit and
int8 targets by default), up to an f32 near-tie at free widths (f32 targets);
16-bit and int8 targets at free widths are refused unless `allow_inexact=True`
(docs/decoding.md, "What lossless guarantees"). Untrained drafters on a
peaked tiny target: some drafts are accepted, most rejected, so both the
accepted-prefix and the bonus paths run. Options are shared across kinds so
that `ar` compiles once per precision and batch.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dloop_jax.decoding import calibration
from dloop_jax.decoding import generate
from dloop_jax.decoding.engine import decode_jaxpr
from dloop_jax.decoding.lossless import near_tie
from dloop_jax.drafters import build_drafter
from dloop_jax.errors import ConfigError
from dloop_jax.models import attention_kernels
from dloop_jax.models.transformer import Transformer, tiny_target
from lossless import assert_same_or_near_tie

KINDS = {
    "eagle3": {"kind": "eagle3", "block_size": 2, "draft_vocab_size": 0},
    "block": {"kind": "block", "block_size": 2, "num_layers": 1},
    "dspark": {"kind": "dspark", "block_size": 2, "markov_rank": 8},
    "domino": {"kind": "domino", "block_size": 2, "gru_hidden_size": 16, "correction_rank": 8},
}
SHAPE = dict(block_size=2, max_stages=2, max_new_tokens=16)
TREE_BUDGET = 4
# gate="auto" with a calibration whose promise alternates between score bins, so that
# rounds stop after one stage or draft two by the stage's score (any decision is lossless).
_ALTERNATING = np.where(np.arange(calibration.NUM_BINS) % 2 == 0, 2.0, 0.0)[None, :].repeat(
    len(calibration.ROWS), axis=0)
AUTO = dict(gate="auto", costs={1: 1.0, 5: 1.2, 9: 1.4, 16: 1.6}, calibration=(
    calibration.Calibration(block_size=2, score="probability", count=np.ones_like(_ALTERNATING),
                            full=np.full_like(_ALTERNATING, 0.5), full_se=0 * _ALTERNATING,
                            accepted=np.ones_like(_ALTERNATING), accepted_se=0 * _ALTERNATING,
                            next_count=np.ones_like(_ALTERNATING), next_accepted=_ALTERNATING,
                            next_accepted_se=0 * _ALTERNATING)))


@pytest.fixture(scope="module")
def targets():
  f32 = tiny_target(seed=1, init_std=0.2)
  bf16 = Transformer.from_params(f32.config, f32.flat_params(), weight_dtype=jnp.bfloat16)
  int8 = Transformer.from_params(f32.config, f32.flat_params(), weight_dtype=jnp.int8)
  return {"f32": f32, "bf16": bf16, "int8": int8}


@pytest.fixture(scope="module")
def drafters(targets):
  return {(kind, precision): build_drafter(config, target=target, rngs=nnx.Rngs(7))
          for kind, config in KINDS.items() for precision, target in targets.items()}


def _prompts(batch: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 64, size=int(rng.integers(2, 12))).tolist() for _ in range(batch)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_f32_free_widths_equal_ar_up_to_near_ties(targets, drafters, kind):
  target, drafter = targets["f32"], drafters[kind, "f32"]
  prompts = _prompts(3, seed=len(kind))
  ar = generate(target, prompts, **SHAPE)
  assert ar.fixed_width is None
  runs = [dict(mode="dloop", gate=-math.inf, schedule="cost"),
          dict(mode="dloop", schedule="cost", **AUTO),
          dict(mode="sd", schedule="off")]
  if drafter.supports_trees:
    runs.append(dict(mode="dloop", gate=-math.inf, tree_budget=TREE_BUDGET))
    runs.append(dict(mode="dloop", tree_budget=TREE_BUDGET, **AUTO))
  for options in runs:
    out = generate(target, prompts, drafter=drafter, **options, **SHAPE)
    assert out.fixed_width is None
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(target, p, want, got)


@pytest.mark.parametrize("kind", list(KINDS))
def test_16_bit_default_equals_ar_bit_for_bit(targets, drafters, kind):
  target, drafter = targets["bf16"], drafters[kind, "bf16"]
  for batch in (1, 3):
    prompts = _prompts(batch, seed=10 * batch + len(kind))
    ar = generate(target, prompts, **SHAPE)
    assert ar.fixed_width == 5  # the cpu profile's width holds 2 stages of 2
    for gate in (dict(gate=-math.inf), dict(gate=-0.5), AUTO):
      out = generate(target, prompts, mode="dloop", drafter=drafter, **gate, **SHAPE)
      assert out.fixed_width == 5
      assert out.tokens == ar.tokens, (kind, batch, gate["gate"])


def test_16_bit_sd_and_the_gpu_profile_equal_ar_bit_for_bit(targets, drafters):
  target, drafter = targets["bf16"], drafters["block", "bf16"]
  prompts = _prompts(3, seed=5)
  sd_shape = dict(SHAPE, max_stages=1)  # sd verifies one stage: ar with the same options
  ar = generate(target, prompts, **sd_shape)
  out = generate(target, prompts, mode="sd", drafter=drafter, **sd_shape)
  assert out.fixed_width == ar.fixed_width == 5 and out.tokens == ar.tokens
  # The accelerator profile on this CPU, as `load_target(profile="gpu")` builds
  # it: bf16 compute and cache, the standard product forms (no out-major
  # matrices, no barriers: `models.cpu_kernels`), its own wider width.
  gpu = Transformer.from_params(target.config, targets["f32"].flat_params(),
                                dtype=jnp.bfloat16, weight_dtype=jnp.bfloat16, cpu_kernels=False)
  gpu_drafter = build_drafter(KINDS["block"], target=gpu, rngs=nnx.Rngs(7))
  assert target.out_major and not gpu.out_major
  ar = generate(gpu, prompts, profile="gpu", **SHAPE)
  out = generate(gpu, prompts, mode="dloop", drafter=gpu_drafter, gate=-math.inf,
                 profile="gpu", **SHAPE)
  assert out.fixed_width == ar.fixed_width == 16 and out.tokens == ar.tokens
  programs = {t.cpu_kernels: str(decode_jaxpr(t, prompts[:1], mode="ar", max_new_tokens=4))
              for t in (target, gpu)}
  assert "optimization_barrier" not in programs[False]
  assert "optimization_barrier" in programs[None]  # the CPU forms, this backend's default


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_int8_default_equals_ar_bit_for_bit(targets, drafters, kind):
  """An int8 target (integer products on XLA:CPU) against plain decoding of itself; with
  the block drafter also the accelerator profile's weight-only form."""
  target, drafter = targets["int8"], drafters[kind, "int8"]
  prompts = _prompts(3, seed=30 + len(kind))
  ar = generate(target, prompts, **SHAPE)
  out = generate(target, prompts, mode="dloop", drafter=drafter, gate=-math.inf, **SHAPE)
  assert out.fixed_width == ar.fixed_width == 5 and out.tokens == ar.tokens
  assert out.total.accepted > 0
  if kind == "block":
    gpu = Transformer.from_params(target.config, targets["f32"].flat_params(),
                                  dtype=jnp.bfloat16, weight_dtype=jnp.int8, cpu_kernels=False)
    gpu_drafter = build_drafter(KINDS["block"], target=gpu, rngs=nnx.Rngs(7))
    ar = generate(gpu, prompts, profile="gpu", **SHAPE)
    out = generate(gpu, prompts, mode="dloop", drafter=gpu_drafter, gate=-math.inf,
                   profile="gpu", **SHAPE)
    assert out.fixed_width == ar.fixed_width == 16 and out.tokens == ar.tokens
    assert out.total.accepted > 0


@pytest.mark.parametrize("precision,options", [
    ("bf16", dict(tree_budget=TREE_BUDGET)),
    ("bf16", dict(schedule="cost")),
    ("bf16", dict(fixed_width=0)),
    ("int8", dict(schedule="cost")),
])
def test_16_bit_free_widths_are_refused_with_the_exact_alternatives(targets, drafters,
                                                                     precision, options):
  target, drafter = targets[precision], drafters["block", precision]
  with pytest.raises(ConfigError, match="would not reproduce mode 'ar' exactly") as e:
    generate(target, _prompts(1, seed=0), mode="dloop", drafter=drafter, **options, **SHAPE)
  assert "weights='f32'" in str(e.value) and "allow_inexact=True" in str(e.value)


def test_the_accelerator_profiles_kernels_in_interpret_mode_keep_ar_outputs():
  """The `gpu` profile's attention (`attention_impl="cudnn"`) with its kernels run in Pallas's
  interpret mode on this CPU: prefill through `jax.nn.dot_product_attention`, one-token steps
  and read-only verifications through Pallas GPU flash decoding; the `tpu` profile's one-token
  steps through Pallas TPU paged attention. At free widths (the profiles' fixed width keeps
  the XLA loop: `models.attention_kernels`)."""
  # head_dim 16: the GPU kernel's smallest; a config no other test compiles (the interpret
  # setting is read while tracing).
  f32 = tiny_target(seed=1, init_std=0.2, head_dim=16)
  models = {impl: Transformer.from_params(f32.config, f32.flat_params(), dtype=jnp.bfloat16,
                                          weight_dtype=jnp.bfloat16, cpu_kernels=False,
                                          attention_impl=impl)
            for impl in ("cudnn", "pallas_tpu")}
  gpu, tpu = models["cudnn"], models["pallas_tpu"]
  drafter = build_drafter(KINDS["block"], target=gpu, rngs=nnx.Rngs(7))
  prompts = _prompts(2, seed=9)
  shape = dict(SHAPE, max_new_tokens=10, fixed_width=0, allow_inexact=True)
  with attention_kernels.interpret():
    for target, profile in ((gpu, "gpu"), (tpu, "tpu")):
      assert "pallas_call" in str(decode_jaxpr(target, prompts, mode="ar", fixed_width=0,
                                               max_new_tokens=4, profile=profile))
    ar = generate(gpu, prompts, profile="gpu", **shape)
    # Widths 3 and 5 (one or two stages): verifications only read the cache (`lax.switch`).
    out = generate(gpu, prompts, mode="dloop", drafter=drafter, gate=-math.inf,
                   schedule="off", profile="gpu", **shape)
    ar_tpu = generate(tpu, prompts, profile="tpu", **shape)
  assert sum(r.verified for r in out.rows) > 0
  # What the programs called, as `python -m infer --json` reports it.
  assert ar.attention_kernels == out.attention_kernels == ("dot_product", "pallas_gpu_interpret")
  assert "pallas_tpu_interpret" in ar_tpu.attention_kernels
  for p, want, got, tpu_got in zip(prompts, ar.tokens, out.tokens, ar_tpu.tokens):
    assert_same_or_near_tie(gpu, p, want, got, tol=near_tie(gpu))
    assert_same_or_near_tie(gpu, p, want, tpu_got, tol=near_tie(gpu))
