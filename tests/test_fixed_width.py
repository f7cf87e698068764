"""`generate(fixed_width=W)`: every target forward at one width, outputs bit-identical."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import drafter_fixtures
import reference
from dloop_jax.decoding import DecodingConfig, SamplingConfig, generate
from dloop_jax.errors import ConfigError
from dloop_jax.models.transformer import Transformer

WIDTH = 7  # >= 1 + max_stages * gamma of every run below


@pytest.fixture(scope="module", params=["f32", "bf16"])
def target(request, tiny):
  if request.param == "f32":
    return tiny
  return Transformer.from_params(tiny.config, tiny.flat_params(), weight_dtype=jnp.bfloat16)


def _forward_program(model: Transformer):
  graph, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, cache, keep):
    m = nnx.merge(graph, state)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
    out = m(tokens, positions=positions, cache=cache)
    return out.logits, out.cache.with_lengths(cache.lengths + keep)

  return lambda tokens, cache, keep: forward(state, tokens, cache, keep)


@pytest.mark.parametrize("seed", range(3))
def test_a_rows_logits_are_the_same_bits_alone_or_among_others_at_one_width(target, seed):
  # The property the mode rests on: in one program shape, a token's row gets
  # the same bits whether the other rows are padding or the next tokens.
  rng = np.random.default_rng(seed)
  batch, prompt_len = 1 + seed, 3 + 4 * seed
  forward = _forward_program(target)
  tokens = jnp.asarray(rng.integers(0, 64, (batch, prompt_len + WIDTH)), jnp.int32)
  cache = target.init_cache(batch_size=batch, capacity=64)
  _, cache = forward(tokens[:, :prompt_len], cache, prompt_len)
  together, _ = forward(tokens[:, prompt_len:], cache, WIDTH)
  for j in range(WIDTH):
    padding = jnp.asarray(rng.integers(0, 64, (batch, WIDTH - 1)), jnp.int32)
    alone, cache = forward(
        jnp.concatenate([tokens[:, prompt_len + j:prompt_len + j + 1], padding], axis=1),
        cache, 1)
    np.testing.assert_array_equal(np.asarray(alone[:, 0]), np.asarray(together[:, j]))


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_outputs_of_every_mode_equal_ar_bit_for_bit(target, batch):
  drafter = drafter_fixtures.perturbed(target, noise_scale=1.0, seed=3)
  rng = np.random.default_rng(batch)
  for _ in range(2):
    prompts = [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(batch)]
    ar = generate(target, prompts, max_new_tokens=24, fixed_width=WIDTH)
    assert all(r.target_tokens == WIDTH * r.rounds for r in ar.rows)
    for mode, gate, stages, gamma in [("sd", -0.5, 1, 3), ("dloop", -0.5, 3, 2),
                                      ("dloop", -math.inf, 3, 2), ("dloop", math.inf, 3, 2)]:
      out = generate(target, prompts, max_new_tokens=24, mode=mode, drafter=drafter,
                     block_size=gamma, gate=gate, max_stages=stages, fixed_width=WIDTH,
                     draft_backoff=2, lookup="off")  # the gate alone decides the stages
      # Exactly equal: no near-tie allowance at one width, in bf16 as in f32.
      assert out.tokens == ar.tokens, (mode, gate)
      for r in out.rows:
        assert r.target_tokens == WIDTH * r.rounds  # every forward ran at the width
        assert r.verified == r.drafted  # schedule "off": every draft verified
      if gate == math.inf:
        assert all(r.stage_histogram[2:] == [0, 0] for r in out.rows)
      if gate == -math.inf:  # every drafting round drafts all three stages
        assert all(r.stage_histogram[1:3] == [0, 0] for r in out.rows)


@pytest.mark.parametrize("mode,gamma", [("sd", 3), ("dloop", 2)])
def test_sampling_keeps_the_target_distribution_at_a_fixed_width(tiny, mode, gamma):
  # The drafts are padded to the width (sd: 3 drafts in a 7-wide forward).
  drafter = drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3)
  sampling = SamplingConfig(temperature=1.0, top_k=5)
  prompt, n = [3, 14, 15], 3000
  out = generate(tiny, [prompt] * n, max_new_tokens=2, mode=mode, drafter=drafter,
                 block_size=gamma, gate=-math.inf, max_stages=3, sampling=sampling, seed=5,
                 fixed_width=WIDTH, draft_backoff=0)
  assert sum(r.accepted for r in out.rows) > 0  # drafts were accepted, not only bonus tokens
  samples = [tuple(t[:2]) for t in out.tokens]
  exact = reference.exact_distribution(tiny, prompt, sampling, depth=2)
  assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3


def test_fixed_width_arguments_are_checked(tiny):
  drafter = drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3)
  prompts = [[1, 2, 3]]
  with pytest.raises(ConfigError, match="narrower than a verification"):
    generate(tiny, prompts, max_new_tokens=4, mode="dloop", drafter=drafter, block_size=2,
             max_stages=3, fixed_width=5)
  with pytest.raises(ConfigError, match="schedule='off'"):
    generate(tiny, prompts, max_new_tokens=4, mode="sd", drafter=drafter, block_size=2,
             fixed_width=5, schedule="cost")
  with pytest.raises(ConfigError, match="tree_budget=0"):
    generate(tiny, prompts, max_new_tokens=4, mode="sd", drafter=drafter, block_size=2,
             fixed_width=5, tree_budget=4)
  with pytest.raises(ConfigError, match="int >= 0"):
    generate(tiny, prompts, max_new_tokens=4, fixed_width=-1)
  with pytest.raises(ConfigError, match="do not combine"):
    generate(tiny, prompts, max_new_tokens=4, fixed_width=4, grow_cache=True)


def test_benchmark_methods_at_a_fixed_width(tiny):
  from infer.bench import methods  # pylint: disable=g-import-not-at-top
  drafter = drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3)
  ar = methods.Ours(decoding=DecodingConfig(mode="ar", fixed_width=WIDTH), target=tiny,
                    max_new_tokens=24)
  sd = methods.Ours(decoding=DecodingConfig(mode="sd", block_size=3, schedule="off",
                                            fixed_width=WIDTH),
                    target=tiny, drafter=drafter, drafter_label="p", max_new_tokens=24)
  assert (ar.label, sd.label) == (f"ar/w{WIDTH}", f"sd/all/w{WIDTH}[p]")
  want, got = ar.run([5, 9, 2]), sd.run([5, 9, 2])
  assert got.tokens == want.tokens
  assert (got.stats.target_tokens == WIDTH * got.stats.rounds
          and want.stats.target_tokens == WIDTH * want.stats.rounds)
