"""The drafters shipped for the default model: found by name, lossless, and the CLI's default."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from dloop_jax.decoding import generate, lossless
from dloop_jax.drafters import io as drafter_io
from dloop_jax.models.config import tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ("smollm2-135m-instruct-block", "smollm2-135m-instruct-eagle3")
PROMPTS = ("What is 17 times 23? Explain step by step.",
           "Write a Python function that reverses a string.")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def real():
  from dloop_jax.models import load_target
  return load_target("smollm2-135m-instruct")


def test_shipped_for_the_default_target_best_first(real):
  assert drafter_io.shipped_drafters_for(real.config) == list(SHIPPED)
  # Another target gets none of them.
  assert drafter_io.shipped_drafters_for(tiny_target(seed=1).config) == []


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafter_is_lossless_on_the_real_model(real, name, tmp_path):
  """dloop (one stage a round, gated, every stage) with the trained drafter reproduces greedy ar.

  Two stages at most, every draft verified: two verification widths to compile on the real
  model (the default S_max and scheduler run on it in the CLI test below and in
  tests/test_bench.py; every shape and schedule on tiny targets in tests/test_engine_*.py).
  The block drafter also goes through the public DFlash layout and back: the same weights and
  the same run (EAGLE-3's round trip: tests/test_hf_formats.py).
  """
  drafter = drafter_io.load_drafter(name, target=real.model)
  tok = real.tokenizer
  prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in PROMPTS]
  stop = tok.stop_token_ids
  ar = generate(real.model, prompts, max_new_tokens=32, stop_tokens=stop)
  dloop = dict(max_new_tokens=32, max_stages=2, schedule="off", stop_tokens=stop)
  accepted = 0
  # The gate is a traced value: one program. g = +inf drafts one stage a round (sd's rounds;
  # mode "sd" itself runs on the real model in tests/test_bench.py).
  for gate in (float("inf"), -0.5, float("-inf")):
    out = generate(real.model, prompts, mode="dloop", drafter=drafter, gate=gate, **dloop)
    for prompt, want, got in zip(prompts, ar.tokens, out.tokens):
      cmp = lossless.compare(real.model, prompt, want, got)
      assert cmp.lossless, (gate, cmp)
    accepted += out.total.accepted
    if gate == float("inf"):
      assert not any(out.total.stage_histogram[2:]), out.total.stage_histogram
    if gate == float("-inf"):
      # S_max stages in every round (no back-off's pauses when every draft is verified).
      hist = out.total.stage_histogram
      assert hist[-1] == out.total.rounds > 0 and not any(hist[:-1]), hist
  assert accepted > 0, "a trained drafter must get some drafts accepted"
  if drafter.spec.kind == "block":
    path = drafter_io.export_drafter(drafter, tmp_path / "dflash", format="hf",
                                     target_name=real.name)
    with open(os.path.join(path, "config.json")) as f:
      assert json.load(f)["architectures"] == ["DFlashDraftModel"]
    loaded = drafter_io.load_drafter(path, target=real.model)
    assert loaded.spec == drafter.spec
    want, got = ({k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(d, nnx.Param))}
                 for d in (drafter, loaded))
    assert sorted(want) == sorted(got)
    for k in want:
      np.testing.assert_array_equal(want[k], got[k], err_msg=str(k))
    again = generate(real.model, prompts, mode="dloop", drafter=loaded, gate=float("-inf"),
                     **dloop)
    assert again.tokens == out.tokens
    assert (again.total.accepted, again.total.drafted) == (out.total.accepted, out.total.drafted)


def test_infer_defaults_to_dloop_with_the_best_shipped_drafter():
  proc = subprocess.run(
      [sys.executable, "-m", "infer", "--prompt", "Name three colors.", "--max-new-tokens", "8",
       "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
      # Eight tokens: compiling dominates, so compile fast (conftest).
      env=dict(os.environ, XLA_FLAGS=os.environ["DLOOP_TEST_REAL_MODEL_XLA_FLAGS"]))
  assert proc.returncode == 0, proc.stderr[-2000:]
  rec = json.loads(proc.stdout.strip().splitlines()[-1])
  assert rec["mode"] == "dloop" and rec["drafter"] == "block"
  assert rec["new_tokens"] == len(rec["output_ids"]) > 0
  assert rec["acceptance_length"] >= 1.0 and rec["rounds"] >= 1
