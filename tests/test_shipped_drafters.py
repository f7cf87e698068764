"""The drafters shipped for the default model: found by name, and their public layout.

Their losslessness on the real model and `python -m infer`'s default:
tests/test_real_model_commands.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from flax import nnx

from dloop_jax.drafters import io as drafter_io
from dloop_jax.models.transformer import tiny_target

SHIPPED = ("smollm2-135m-instruct-block", "smollm2-135m-instruct-domino",
           "smollm2-135m-instruct-dspark", "smollm2-135m-instruct-eagle3")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def real():
  from dloop_jax.models import load_target
  return load_target("smollm2-135m-instruct", dtype="float32")


def test_shipped_for_the_default_target_best_first(real):
  assert drafter_io.shipped_drafters_for(real.config) == list(SHIPPED)
  # Another target gets none of them.
  assert drafter_io.shipped_drafters_for(tiny_target(seed=1).config) == []


def test_block_drafter_round_trips_through_the_public_dflash_layout(real, tmp_path):
  """The shipped block drafter exported in DFlash's layout and loaded back: the same spec and
  the same weights, so the same runs (EAGLE-3's round trip: tests/test_hf_formats.py; the
  shipped drafters' losslessness on the real model: tests/test_real_model_commands.py)."""
  drafter = drafter_io.load_drafter(SHIPPED[0], target=real.model)
  assert drafter.spec.kind == "block"
  # Its draft vocabulary (the target's head restricted to 16,384 ids) is not in DFlash's
  # layout: written and read back, it drafts over the whole head with the same weights.
  assert drafter.spec.draft_vocab_size == 16384
  with pytest.warns(UserWarning, match="no draft vocabulary"):
    path = drafter_io.export_drafter(drafter, tmp_path / "dflash", format="hf",
                                     target_name=real.name)
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["architectures"] == ["DFlashDraftModel"]
  loaded = drafter_io.load_drafter(path, target=real.model)
  assert loaded.spec == dataclasses.replace(drafter.spec, draft_vocab_size=0)
  want, got = ({k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(d, nnx.Param))}
               for d in (drafter, loaded))
  assert sorted(want) == sorted(got)
  for k in want:
    np.testing.assert_array_equal(want[k], got[k], err_msg=str(k))


def test_domino_drafter_is_restricted_and_its_correction_head_trained(real):
  """The shipped Domino drafter drafts over 16,384 ids and its correction head changes what it
  drafts (head off: `train.evaluate --heads-off`); its losslessness on the real model:
  tests/test_real_model_commands.py."""
  import jax  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.ablation import without_head  # pylint: disable=g-import-not-at-top

  drafter = drafter_io.load_drafter(SHIPPED[1], target=real.model)
  assert drafter.spec.kind == "domino" and drafter.spec.draft_vocab_size == 16384
  h = jax.random.normal(jax.random.key(0), (1, drafter.block_size, real.config.hidden_size))
  tokens = jax.random.randint(jax.random.key(1), (1, drafter.block_size), 0, 1000)
  base, corrected = drafter.corrected_logits(h, tokens)
  assert base.shape[-1] == 16384
  assert np.abs(np.asarray(corrected - base)[:, 1:]).max() > 0.1
  _, off = without_head(drafter, "correction").corrected_logits(h, tokens)
  np.testing.assert_array_equal(np.asarray(off), np.asarray(base))


def test_dspark_drafter_is_restricted_and_its_heads_trained(real):
  """The shipped DSpark drafter drafts over 16,384 ids, its Markov head changes what it drafts
  (head off: `train.evaluate --heads-off`), and its confidence head gives c_k in (0, 1) that
  tell positions apart."""
  import jax  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.ablation import without_head  # pylint: disable=g-import-not-at-top

  drafter = drafter_io.load_drafter("smollm2-135m-instruct-dspark", target=real.model)
  assert drafter.spec.kind == "dspark" and drafter.spec.draft_vocab_size == 16384
  assert drafter.has_confidence
  state = drafter.init_state(batch_size=1, capacity=8)
  h = jax.random.normal(jax.random.key(0), (1, drafter.block_size, real.config.hidden_size))
  prev = jax.random.randint(jax.random.key(1), (1, drafter.block_size), 0, 1000)
  logits = drafter.head_logits(h, prev, head_rows=state.head_rows, markov_rows=state.markov_rows)
  base = drafter.draft_logits(h, head_rows=state.head_rows)
  assert logits.shape[-1] == 16384
  assert np.abs(np.asarray(logits - base)).max() > 0.1
  off = without_head(drafter, "markov")
  off_state = off.init_state(batch_size=1, capacity=8)
  np.testing.assert_array_equal(
      np.asarray(off.head_logits(h, prev, head_rows=off_state.head_rows,
                                 markov_rows=off_state.markov_rows)), np.asarray(base))
  c = np.asarray(jax.nn.sigmoid(drafter.confidence_logit(h, prev)))
  assert ((c > 0) & (c < 1)).all() and np.ptp(c) > 0.01
