"""Greedy losslessness of sd and dloop, as a property over many settings.

Every setting runs under the verification scheduler with cost tables that
force each choice: the CPU table of the test session (conftest), a flat one
(verify every draft), a steep one (verify none: plain decode steps) and a
random one per seed (any width). Tables are traced: the steep ones and the
random ones (compiled with every width, `width_tolerance=0`) share one program;
the flat one compiles the two widths an accelerator's flat table keeps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import drafter_fixtures
from dloop_jax.decoding import SamplingConfig, engine, generate
from dloop_jax.decoding import plan as plan_lib
from lossless import assert_same_or_near_tie

GATES = (-math.inf, -0.5, 0.0, math.inf)
WIDEST = 1 + 4 * 3
FLAT = {1: 1.0, WIDEST: 1.0}
STEEP = {w: 10.0 ** w for w in range(1, WIDEST + 1)}
# Settings that also run with schedule="off" (every draft verified: one more program each).
OFF = ((1, 1, 3), (4, 3, 3))


def _tables(rng):
  """None (the session's CPU table), flat, steep, and a random (non-monotone) table."""
  random = {w: float(c) for w, c in zip(range(1, WIDEST + 1), rng.uniform(1.0, 3.0, WIDEST))}
  return [None, FLAT, STEEP, random]


def _prompts(rng, batch):
  return [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(batch)]


def _drafters(target):
  return {
      "oracle": drafter_fixtures.oracle(target),
      "perturbed": drafter_fixtures.perturbed(target, noise_scale=1.0, seed=3),
      "random": drafter_fixtures.random_drafter(target, seed=4),
  }


@pytest.fixture(scope="module")
def drafters(tiny):
  return _drafters(tiny)


# Every shape with a batch of rows of different lengths, and one with a single row (each
# shape and batch size is programs of its own: compiling them is most of the time; the
# real model decodes single rows in tests/test_real_model_commands.py).
SHAPES = [(1, 1), (1, 3), (3, 2), (4, 3)]


@pytest.mark.parametrize("gamma,max_stages,batch",
                         [(g, s, 3) for g, s in SHAPES] + [(3, 2, 1)])
def test_greedy_lossless(tiny, drafters, gamma, max_stages, batch):
  rng = np.random.default_rng(gamma * 100 + max_stages * 10 + batch)
  # A length that is not a multiple of the block so the limit falls inside one.
  max_new = 3 * gamma * max_stages + 2
  plain = verified_all = 0
  for seed in range(2):
    prompts = _prompts(rng, batch)
    ar = generate(tiny, prompts, max_new_tokens=max_new)
    tables = _tables(rng)
    for name, drafter in drafters.items():
      tables = tables[1:] + tables[:1]  # every drafter meets every table with another gate
      runs = ([("sd", None, "cost", t) for t in tables[:2]]
              + [("dloop", g, "cost", t) for g, t in zip(GATES, tables)]
              + [("dloop", -0.5, "cost", tables[2])])
      if seed == 0 and (gamma, max_stages, batch) in OFF:
        runs += [("sd", None, "off", None), ("dloop", -0.5, "off", None)]
      for mode, g, schedule, costs in runs:
        # A random table would compile the widths it happens to leave worth
        # compiling (a program per draw): it runs on the every-width program.
        every_width = {} if costs is FLAT else {"width_tolerance": 0.0}
        out = generate(tiny, prompts, max_new_tokens=max_new, mode=mode, drafter=drafter,
                       block_size=gamma, gate=-0.5 if g is None else g, max_stages=max_stages,
                       schedule=schedule, costs=costs, **every_width)
        for p, want, got in zip(prompts, ar.tokens, out.tokens):
          assert len(got) == max_new
          assert_same_or_near_tie(tiny, p, want, got)
        assert out.total.new_tokens == ar.total.new_tokens, (name, mode, g)
        t = out.total
        assert t.accepted <= t.verified <= t.drafted
        if schedule == "off" or costs is FLAT:
          # Every drafted draft is verified; rounds without drafts are the back-off's
          # pauses (none with schedule="off", whose default back-off is 0).
          assert t.verified == t.drafted
          assert t.plain_rounds == sum(r.stage_histogram[0] for r in out.rows)
          if schedule == "off":
            assert t.plain_rounds == 0
        if costs is STEEP:
          assert t.verified == 0 and t.plain_rounds == t.rounds
        plain += t.plain_rounds
        verified_all += t.verified == t.drafted
  assert plain > 0 and verified_all > 0


def test_stop_tokens_inside_accepted_blocks(tiny, drafters):
  rng = np.random.default_rng(7)
  prompts = _prompts(rng, 3)
  free = generate(tiny, prompts, max_new_tokens=24)
  # Stop on a token that appears mid-way in some row's free-running output.
  stop = free.tokens[0][5]
  ar = generate(tiny, prompts, max_new_tokens=24, stop_tokens=[stop])
  for row, full in zip(ar.tokens, free.tokens):
    cut = full.index(stop) + 1 if stop in full else len(full)
    assert row == full[:cut]
  for drafter in drafters.values():
    for mode, g in (("sd", 0.0), ("dloop", -math.inf), ("dloop", -0.5)):
      out = generate(tiny, prompts, max_new_tokens=24, mode=mode, drafter=drafter, block_size=4,
                     gate=g, max_stages=3, stop_tokens=[stop])
      assert out.tokens == ar.tokens


def test_oracle_accepts_everything(tiny, drafters):
  prompts = [[1, 2, 3]]
  out = generate(tiny, prompts, max_new_tokens=1 + 13 * 5, mode="dloop",
                 drafter=drafters["oracle"], block_size=4, gate=-math.inf, max_stages=3,
                 schedule="off", lookup="off")
  row = out.rows[0]
  assert row.accepted == row.drafted
  assert row.acceptance_length == 13.0
  assert row.stage_histogram == [0, 0, 0, 5]


def test_random_drafter_rarely_accepted(tiny, drafters):
  prompts = [[5, 6, 7], [9]]
  # The drafter's own drafts (the prompt lookup would supply accepted ones).
  out = generate(tiny, prompts, max_new_tokens=40, mode="sd", drafter=drafters["random"],
                 block_size=3, schedule="off", lookup="off")
  assert out.total.acceptance_length < 1.3


def test_perturbed_partial_acceptance(tiny, drafters):
  prompts = [[5, 6, 7], [9, 1, 2, 3]]
  out = generate(tiny, prompts, max_new_tokens=40, mode="sd", drafter=drafters["perturbed"],
                 block_size=3, schedule="off", lookup="off")
  assert 1.2 < out.total.acceptance_length < 3.5


def test_cache_ladder_grows_past_the_prompt_to_the_capacity():
  for prompt_width, capacity in [(16, 64), (48, 384), (512, 1024), (96, 3072), (1000, 1024)]:
    ladder = plan_lib.cache_ladder(prompt_width=prompt_width, capacity=capacity)
    assert ladder[-1] == capacity and list(ladder) == sorted(set(ladder))
    assert ladder[0] > min(prompt_width, capacity - 1)
    assert len(ladder) <= plan_lib.GROW_MAX_STEPS + 1


def test_growing_cache_gives_the_same_tokens_and_taps(tiny):
  # Rows of very different lengths, 150 new tokens: the cache grows 64 -> 192
  # slots in three steps while rows finish at different times. Sampled, so the
  # keys must be used as with a fixed cache; greedy builds compare with
  # `generate()` in tests/test_data_target_responses.py.
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 9, 30, 17)]
  args = dict(max_new_tokens=150, capture_taps=(0, 1), stop_tokens=(5,),
              sampling=SamplingConfig(temperature=1.0), seed=2)
  fixed = generate(tiny, prompts, **args)
  grown = generate(tiny, prompts, grow_cache=True, **args)
  assert grown.tokens == fixed.tokens
  assert len({len(t) for t in fixed.tokens}) > 1  # some rows stop early
  for a, b in zip(grown.features, fixed.features):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
