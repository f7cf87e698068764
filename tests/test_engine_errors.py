"""generate() rejects bad input before compiling, with an error that names the problem."""

from __future__ import annotations

import math

import pytest

import draft_training
import drafter_fixtures
from dloop_jax.decoding import generate
from dloop_jax.errors import ConfigError, DrafterMismatchError
from dloop_jax.models.config import tiny_config

PROMPT = [[1, 2, 3]]


@pytest.fixture(scope="module")
def oracle(tiny):
  return drafter_fixtures.oracle(tiny)


@pytest.mark.parametrize("kind", ["eagle3", "block"])
@pytest.mark.parametrize("other,taps,match", [
    (dict(hidden_size=48), None, "hidden_size: drafter expects 48, target has 32"),
    (dict(vocab_size=80), None, "vocab_size: drafter expects 80, target has 64"),
    (dict(num_layers=4), [3], r"tapped layers \[3\] do not exist in a 2-layer target"),
])
def test_drafter_built_for_another_target(tiny, kind, other, taps, match):
  """A drafter built (by build_drafter) for another tiny target is refused, saying what differs.

  The drafter is abstract (no weights allocated): the check reads only its structure.
  """
  config = {"kind": kind, "block_size": 2}
  if taps is not None:
    config["taps"] = taps
  drafter = draft_training.abstract_drafter(config, tiny_config(**other))
  assert drafter.name == kind
  for mode in ("sd", "dloop"):
    with pytest.raises(DrafterMismatchError, match=match) as err:
      generate(tiny, PROMPT, max_new_tokens=4, mode=mode, drafter=drafter, block_size=2)
    assert "built for another target" in str(err.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), r"block_size \(gamma\) must be an int >= 1, got 0"),
    (dict(block_size=-2), r"block_size \(gamma\) must be an int >= 1, got -2"),
    (dict(block_size=2.0), r"block_size \(gamma\) must be an int >= 1"),
    (dict(max_stages=0), r"max_stages \(S_max\) must be an int >= 1, got 0"),
    (dict(gate=math.nan), r"gate must be a number \(-inf and \+inf allowed\) or .auto., got nan"),
    (dict(gate="high"), "gate must be a number"),
    (dict(mode="loop"), r"mode must be one of \('ar', 'sd', 'dloop'\), got 'loop'"),
    (dict(drafter=None), "mode 'dloop' needs a drafter"),
    (dict(mode="sd", drafter=None), "mode 'sd' needs a drafter"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(grow_cache=True), "grow_cache is only supported in mode='ar'"),
])
def test_bad_arguments(tiny, oracle, kwargs, match):
  """Bad gamma, S_max, gate, mode, missing drafter or length: ConfigError naming it."""
  args = dict(max_new_tokens=4, mode="dloop", drafter=oracle, block_size=2, gate=-0.5,
              max_stages=2)
  args.update(kwargs)
  with pytest.raises(ConfigError, match=match):
    generate(tiny, PROMPT, **args)


def test_block_larger_than_a_block_drafter_drafts(tiny):
  """A block drafter drafts at most its block size per stage; an autoregressive one any."""
  block = draft_training.abstract_drafter({"kind": "block", "block_size": 3}, tiny.config)
  for mode in ("sd", "dloop"):
    with pytest.raises(ConfigError, match=r"block_size 4 exceeds .*'block'.* \(3\)"):
      generate(tiny, PROMPT, max_new_tokens=4, mode=mode, drafter=block, block_size=4)
  assert block.max_block_size() == 3
  eagle = draft_training.abstract_drafter({"kind": "eagle3", "block_size": 3}, tiny.config)
  assert eagle.max_block_size() is None

