"""Greedy losslessness of sd and dloop, as a property over many settings."""

from __future__ import annotations

import math

import numpy as np
import pytest

import drafter_fixtures
from dloop_jax.decoding import generate
from lossless import assert_same_or_near_tie

GATES = (-math.inf, -0.5, 0.0, math.inf)


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


@pytest.mark.parametrize("gamma,max_stages", [(1, 1), (1, 3), (3, 2), (4, 3), (3, 1), (4, 2)])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless(tiny, drafters, gamma, max_stages, batch):
  rng = np.random.default_rng(gamma * 100 + max_stages * 10 + batch)
  # A length that is not a multiple of the block so the limit falls inside one.
  max_new = 3 * gamma * max_stages + 2
  for seed in range(2):
    prompts = _prompts(rng, batch)
    ar = generate(tiny, prompts, max_new_tokens=max_new)
    for name, drafter in drafters.items():
      runs = [("sd", None)] + [("dloop", g) for g in GATES]
      for mode, g in runs:
        out = generate(tiny, prompts, max_new_tokens=max_new, mode=mode, drafter=drafter,
                       block_size=gamma, gate=-0.5 if g is None else g, max_stages=max_stages)
        for p, want, got in zip(prompts, ar.tokens, out.tokens):
          assert len(got) == max_new
          assert_same_or_near_tie(tiny, p, want, got)
        assert out.total.new_tokens == ar.total.new_tokens, (name, mode, g)


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
                 drafter=drafters["oracle"], block_size=4, gate=-math.inf, max_stages=3)
  row = out.rows[0]
  assert row.accepted == row.drafted
  assert row.acceptance_length == 13.0
  assert row.stage_histogram == [0, 0, 0, 5]


def test_random_drafter_rarely_accepted(tiny, drafters):
  prompts = [[5, 6, 7], [9]]
  out = generate(tiny, prompts, max_new_tokens=40, mode="sd", drafter=drafters["random"],
                 block_size=3)
  assert out.total.acceptance_length < 1.3


def test_perturbed_partial_acceptance(tiny, drafters):
  prompts = [[5, 6, 7], [9, 1, 2, 3]]
  out = generate(tiny, prompts, max_new_tokens=40, mode="sd", drafter=drafters["perturbed"],
                 block_size=3)
  assert 1.2 < out.total.acceptance_length < 3.5
