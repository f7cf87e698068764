"""`python -m infer`'s decoding shape: bf16 weights, every forward 5 tokens wide by default."""

from __future__ import annotations

import pytest

from dloop_jax.decoding import arguments
from dloop_jax.errors import ConfigError
from infer.__main__ import DEFAULT_FIXED_WIDTH, _decoding_shape, _parse


@pytest.mark.parametrize("argv,mode,want", [
    # Default: bf16 weights at the fixed width; dloop fits it with 2 stages of 2.
    ([], "dloop", (DEFAULT_FIXED_WIDTH, 2, 2)),
    ([], "sd", (DEFAULT_FIXED_WIDTH, None, 3)),  # the drafter's gamma
    ([], "ar", (DEFAULT_FIXED_WIDTH, None, 3)),  # ar at the same width: the same tokens
    # The user's gamma / S_max are kept (a verification too wide for W is generate()'s error).
    (["--max-stages", "1"], "dloop", (DEFAULT_FIXED_WIDTH, None, 1)),
    (["--block-size", "4"], "dloop", (DEFAULT_FIXED_WIDTH, 4, 3)),
    # No fixed width: f32 weights, trees, an explicit cost schedule, or asked for.
    (["--weights", "f32"], "dloop", (0, None, 3)),
    (["--tree-budget", "8"], "dloop", (0, None, 3)),
    (["--schedule", "cost"], "dloop", (0, None, 3)),
    (["--fixed-width", "0"], "dloop", (0, None, 3)),
    (["--fixed-width", "9", "--block-size", "4", "--max-stages", "2"], "dloop", (9, 4, 2)),
])
def test_decoding_shape(argv, mode, want):
  assert _decoding_shape(_parse(argv), mode=mode, drafter_block_size=4) == want


@pytest.mark.parametrize("width,gamma,max_stages,want", [
    (5, 4, 3, (2, 2)), (9, 4, 3, (4, 2)), (13, 4, 3, (4, 3)), (13, 4, 2, (4, 2)),
    (3, 4, 3, (1, 2)), (7, 2, 3, (2, 3)), (17, 8, 3, (8, 2)),
])
def test_loop_shape_for_width(width, gamma, max_stages, want):
  got = arguments.loop_shape_for_width(width, drafter_block_size=gamma, max_stages=max_stages)
  assert got == want
  assert arguments.full_verification_width(mode="dloop", block_size=got[0],
                                           max_stages=got[1]) <= width


def test_loop_shape_for_a_width_too_narrow():
  with pytest.raises(ConfigError, match="no room for two drafting stages"):
    arguments.loop_shape_for_width(2, drafter_block_size=4, max_stages=3)


def test_default_weights_are_bf16():
  assert _parse([]).weights == "bf16"
