"""`without_head`: a drafter with its DSpark Markov / Domino correction head switched off,
and `python -m train.evaluate`, which measures those ablations."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from dloop_jax.drafters import build_drafter
from dloop_jax.drafters.ablation import heads, without_head
from dloop_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trained_like(config, target):
  """A drafter of `config` whose every weight is nonzero (heads' output matrices included)."""
  drafter = build_drafter(config, target=target, rngs=nnx.Rngs(1))
  nnx.update(drafter, jax.tree.map(lambda x: x + 0.02, nnx.state(drafter, nnx.Param)))
  return drafter


def _params(drafter):
  return {path: np.asarray(v.get_value())
          for path, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


def test_domino_without_correction_drafts_from_the_base_logits(tiny):
  domino = _trained_like({"kind": "domino", "block_size": 3, "num_layers": 1,
                          "gru_hidden_size": 8, "correction_rank": 4}, tiny)
  before = _params(domino)
  off = without_head(domino, "correction")
  h = jax.random.normal(jax.random.key(0), (2, 3, tiny.config.hidden_size))
  tokens = jax.random.randint(jax.random.key(1), (2, 3), 0, tiny.config.vocab_size)
  base, corrected = domino.corrected_logits(h, tokens)
  off_base, off_corrected = off.corrected_logits(h, tokens)
  # The head was on: it changed the logits after the first position.
  assert not np.allclose(np.asarray(base[:, 1:]), np.asarray(corrected[:, 1:]))
  np.testing.assert_array_equal(np.asarray(off_base), np.asarray(base))
  np.testing.assert_array_equal(np.asarray(off_corrected), np.asarray(base))
  # The original is untouched; the copy differs in the head's output matrix only.
  after, copy = _params(domino), _params(off)
  for path, value in before.items():
    np.testing.assert_array_equal(after[path], value)
    if path[-1] == "correction_w2":
      assert not copy[path].any()
    else:
      np.testing.assert_array_equal(copy[path], value, err_msg=str(path))


def test_dspark_without_markov_keeps_backbone_logits_and_confidence(tiny):
  dspark = _trained_like({"kind": "dspark", "block_size": 3, "num_layers": 1,
                          "markov_rank": 4}, tiny)
  off = without_head(dspark, "markov")
  h = jax.random.normal(jax.random.key(2), (2, 3, tiny.config.hidden_size))
  prev = jax.random.randint(jax.random.key(3), (2, 3), 0, tiny.config.vocab_size)
  assert not np.allclose(np.asarray(dspark.head_logits(h, prev)),
                         np.asarray(dspark.draft_logits(h)))
  np.testing.assert_array_equal(np.asarray(off.head_logits(h, prev)),
                                np.asarray(dspark.draft_logits(h)))
  # The confidence head reads the Markov head's input embedding, which stays.
  np.testing.assert_array_equal(np.asarray(off.confidence_logit(h, prev)),
                                np.asarray(dspark.confidence_logit(h, prev)))


def test_heads_and_refusals(tiny):
  block = build_drafter({"kind": "block", "block_size": 3, "num_layers": 1}, target=tiny,
                        rngs=nnx.Rngs(0))
  bare = build_drafter({"kind": "dspark", "block_size": 3, "num_layers": 1, "markov_rank": 0},
                       target=tiny, rngs=nnx.Rngs(0))
  domino = build_drafter({"kind": "domino", "block_size": 3, "num_layers": 1}, target=tiny,
                         rngs=nnx.Rngs(0))
  assert heads(block) == () and heads(bare) == () and heads(domino) == ("correction",)
  with pytest.raises(ConfigError, match=r"block drafter has no markov head .*this one's: none"):
    without_head(block, "markov")
  with pytest.raises(ConfigError, match="domino drafter has no markov head"):
    without_head(domino, "markov")
  with pytest.raises(ConfigError, match=r"Unknown head 'gru'.*\['correction', 'markov'\]"):
    without_head(domino, "gru")


@pytest.mark.parametrize("args, message", [
    (["--drafters", ","], "--drafters names no drafter"),
    (["--drafters", "x", "--modes", "sd,tree"], "--modes must be a non-empty subset"),
    (["--drafters", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_evaluate_cli_refuses_bad_arguments_before_loading(args, message):
  proc = subprocess.run([sys.executable, "-m", "train.evaluate", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_evaluate_cli_reports_a_missing_prompts_file(tmp_path):
  missing = tmp_path / "prompts.jsonl"
  proc = subprocess.run([sys.executable, "-m", "train.evaluate", "--drafters",
                         "smollm2-135m-instruct-block", "--prompts", str(missing)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "prompts.jsonl" in last, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
