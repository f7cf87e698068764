"""bf16 compute (`dtype=bfloat16`): storage, f32 logits, and greedy outputs equal to bf16 `ar`.

Speculative outputs are compared with the bf16 target's own `ar` output under
the near-tie rule at bf16 resolution (`lossless.near_tie`: the read-only
verification and single-token steps may round a hidden state to neighbouring
bf16 values).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drafter_fixtures
import model_fixtures
from dloop_jax.decoding import generate
from dloop_jax.decoding.lossless import NEAR_TIE_BF16, compare, near_tie
from dloop_jax.errors import ConfigError
from dloop_jax.models import load_target
from dloop_jax.models.registry import precision
from dloop_jax.models.transformer import Transformer

COSTS = {1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6, 13: 66.8, 17: 72.0, 25: 82.0}


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
  return Transformer.from_params(tiny.config, tiny.flat_params(), dtype=jnp.bfloat16)


def test_precision_combinations():
  assert precision() == (jnp.float32, jnp.float32)
  assert precision("float32", "bf16") == (jnp.float32, jnp.bfloat16)
  assert precision("bfloat16") == (jnp.bfloat16, jnp.bfloat16)
  with pytest.raises(ConfigError, match="dtype=bfloat16 with weights=f32 is not a supported"):
    precision("bfloat16", "f32")
  with pytest.raises(ConfigError, match="dtype must be one of"):
    precision("float16")


def test_load_target_in_bf16(tmp_path):
  hf_dir = model_fixtures.save_hf(model_fixtures.tiny_hf_model("qwen3_tied"),
                                  str(tmp_path / "tiny"))
  f32 = load_target(hf_dir, dtype="float32").model
  bf16 = load_target(hf_dir, dtype="bfloat16").model
  assert {v.dtype for v in bf16.flat_params().values()} == {np.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(bf16.flat_params()["embed"],
                                f32.flat_params()["embed"].astype(jnp.bfloat16))
  assert near_tie(bf16) == NEAR_TIE_BF16 and near_tie(f32) < NEAR_TIE_BF16
  assert bf16.attention_impl == "xla"  # this CPU's profile
  gpu = load_target(hf_dir, profile="gpu").model
  assert (gpu.attention_impl, gpu.dtype) == ("cudnn", jnp.bfloat16)
  tokens = jnp.asarray([[3, 5, 7, 11, 13]], jnp.int32)
  out = jax.eval_shape(lambda: bf16(tokens, positions=jnp.arange(5)[None],
                                    cache=bf16.init_cache(batch_size=1, capacity=8)))
  assert out.logits.dtype == jnp.float32  # logits (and so acceptance) in f32
  assert out.cache.k[0].dtype == jnp.bfloat16 and out.hidden.dtype == jnp.bfloat16


def test_greedy_dloop_equals_bf16_ar(tiny_bf16):
  # Two stages per drafting round. By default bf16 compute runs every forward
  # at one width (the same tokens as ar with the same options); with
  # allow_inexact the cost schedule verifies a prefix of the drafts through
  # the lax.switch over widths, within bf16 rounding of ar's tokens.
  drafter = drafter_fixtures.perturbed(tiny_bf16, noise_scale=1.0, seed=3)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(3)]
  shape = dict(block_size=3, max_stages=2)
  exact_ar = generate(tiny_bf16, prompts, max_new_tokens=20, **shape)
  exact = generate(tiny_bf16, prompts, max_new_tokens=20, mode="dloop", drafter=drafter,
                   gate=-math.inf, **shape)
  assert exact.fixed_width == 7 and exact.tokens == exact_ar.tokens
  ar = generate(tiny_bf16, prompts, max_new_tokens=20, fixed_width=0)
  out = generate(tiny_bf16, prompts, max_new_tokens=20, mode="dloop", drafter=drafter,
                 gate=-math.inf, costs=COSTS, schedule="cost", allow_inexact=True, **shape)
  assert out.total.accepted > 0
  hist = np.sum([r.stage_histogram for r in out.rows], axis=0)
  assert hist[2] > 0, hist
  comparisons = [compare(tiny_bf16, p, want, got)
                 for p, want, got in zip(prompts, ar.tokens, out.tokens)]
  assert all(c.lossless for c in comparisons), (comparisons, ar.tokens, out.tokens)
  assert sum(c.identical for c in comparisons) >= 2  # a near-tie flip is the exception
