"""`infer.bench.quality`: the figures that compare two computations of a target.

llama.cpp's computation (`quality.LlamaCpp`) on the default GGUF: tests/test_bench_llama_cpp.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from dloop_jax.models.transformer import tiny_target
from infer.bench import quality

PROMPTS = [[1, 5, 9, 12], [3, 4], [7, 8, 9, 10, 11, 2]]


def test_a_computation_against_itself_agrees_everywhere(tiny):
  ours = quality.Ours(tiny)
  r = quality.compare(ours, ours, PROMPTS, max_new_tokens=6)
  assert r == dict(prompts=3, prefix=6.0, identical=1.0, top1=1.0, kl=pytest.approx(0, abs=1e-9),
                   positions=18)


def test_another_model_differs_and_the_figures_say_how_much(tiny):
  r = quality.compare(quality.Ours(tiny), quality.Ours(tiny_target(seed=2)), PROMPTS,
                      max_new_tokens=6)
  assert r["identical"] < 1 and r["prefix"] < 6 and r["top1"] < 1 and r["kl"] > 0.01


def test_teacher_forced_logits_predict_the_greedy_answer(tiny):
  """Row i of `logits(ids)` is the distribution of token i + 1: its argmax over the answer
  span is the greedy answer itself (an off-by-one would compare other positions)."""
  ours = quality.Ours(tiny)
  ids = PROMPTS[0]
  answer = ours.greedy(ids, max_new_tokens=6)
  logits = ours.logits(ids + answer)
  assert logits.shape == (len(ids) + 6, tiny.config.vocab_size)
  np.testing.assert_array_equal(logits[len(ids) - 1:-1].argmax(-1), answer)


def test_unknown_computation_is_refused_before_loading(capsys):
  assert quality.main(["--weights", "int4"]) == 2
  assert "--weights takes int8, bf16 and / or llama_cpp" in capsys.readouterr().err
