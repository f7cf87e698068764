"""The trainer's draft vocabulary: the most frequent response tokens of the training data.

A fresh drafter with a reduced draft vocabulary counts the training split once;
a resumed or `init_from` drafter keeps the maps stored with its weights, and
exports carry them to `load_drafter`.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np
import pytest
from ml_collections import ConfigDict

import trainer_hooks
from dloop_jax.data import pipeline
from dloop_jax.drafters import io as drafter_io
from dloop_jax.models.transformer import tiny_target
from dloop_jax.training import checkpointing as ckpt_lib
from dloop_jax.training import hooks as hooks_lib
from dloop_jax.training import trainer as trainer_lib

DRAFT_VOCAB = 16  # of the tiny target's 64


def _config(**overrides) -> ConfigDict:
  c = trainer_hooks.tiny_config(hooks="", **overrides)
  c.drafter = ConfigDict(dict(kind="eagle3", block_size=2, draft_vocab_size=DRAFT_VOCAB))
  c.objective_cfg = ConfigDict(dict(ttt_steps=2, step_decay=0.8))
  c.checkpoint.every_steps = 2
  return c


def _no_counting(*args, **kwargs):
  raise AssertionError("token counts must not be recomputed: the maps come with the weights")


def _expected_d2t(data_dir: str) -> np.ndarray:
  """The DRAFT_VOCAB most frequent response tokens (ties: lower id), counted here on its own."""
  counts = collections.Counter()
  source = pipeline.data_source(data_dir)
  for i in range(len(source)):
    example = source[i]
    counts.update(int(t) for t, m in zip(example["tokens"], example["loss_mask"]) if m)
  ranked = sorted(range(64), key=lambda t: (-counts[t], t))
  return np.sort(np.asarray(ranked[:DRAFT_VOCAB], np.int32))


def _checkpoint_maps(workdir: str, step: int) -> dict[str, np.ndarray]:
  with ckpt_lib.ocp.StandardCheckpointer() as c:
    out = c.restore(os.path.join(workdir, "checkpoints", str(step), "model_state"))
  return {k: np.asarray(v) for k, v in out.items()}


def _check_maps(d2t, t2d, expected):
  np.testing.assert_array_equal(np.asarray(d2t), expected)
  t2d = np.asarray(t2d)
  np.testing.assert_array_equal(t2d[expected], np.arange(DRAFT_VOCAB))
  assert (np.delete(t2d, expected) == -1).all()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Two steps from scratch, then resumed (and exported) without counting again."""
  workdir = str(tmp_path_factory.mktemp("vocab"))
  first = trainer_lib.train(_config(num_steps=2, export__enabled=False), workdir)
  hooks = dataclasses.replace(hooks_lib.default_hooks(), token_counts=_no_counting)
  second = trainer_lib.train(_config(num_steps=2), workdir, hooks=hooks)
  return workdir, first, second, _expected_d2t(os.path.join(workdir, "data"))


def test_draft_vocab_is_the_most_frequent_response_tokens(run):
  workdir, first, _, expected = run
  assert first.step == 2
  # Not the placeholder (the first ids): the counts were used.
  assert not np.array_equal(expected, np.arange(DRAFT_VOCAB))
  maps = _checkpoint_maps(workdir, 2)
  _check_maps(maps["d2t"], maps["t2d"], expected)


def test_resume_keeps_the_maps(run):
  workdir, _, second, expected = run
  assert second.resumed_from == 2 and second.step == 2
  # The export is written from the restored state.
  info = drafter_io.read_info(second.export_dir)
  _, maps = drafter_io.read_arrays(second.export_dir, info)
  _check_maps(maps["d2t"], maps["t2d"], expected)


def test_export_and_load_drafter_keep_the_maps(run):
  workdir, _, second, expected = run
  drafter = drafter_io.load_drafter(second.export_dir, target=tiny_target(seed=1))
  _check_maps(drafter.d2t[...], drafter.t2d[...], expected)
  maps = _checkpoint_maps(workdir, 2)
  np.testing.assert_array_equal(np.asarray(drafter.d2t[...]), maps["d2t"])
  np.testing.assert_array_equal(np.asarray(drafter.t2d[...]), maps["t2d"])


@pytest.mark.parametrize("source", ["workdir", "export"])
def test_init_from_takes_the_maps_of_its_source(run, source):
  workdir, _, second, expected = run
  t = trainer_lib.Trainer(_config(recipe="loop"))
  # A fresh trainer holds the placeholder maps until train() counts.
  np.testing.assert_array_equal(np.asarray(t.model_state["d2t"]), np.arange(DRAFT_VOCAB))
  t.init_from(workdir if source == "workdir" else second.export_dir)
  _check_maps(t.model_state["d2t"], t.model_state["t2d"], expected)
  np.testing.assert_array_equal(np.asarray(t.drafter_with().d2t[...]), expected)


def test_dataset_token_counts(run):
  workdir, _, _, _ = run
  data = os.path.join(workdir, "data")
  source = pipeline.data_source(data)
  want = np.zeros((64,), np.int64)
  for i in range(len(source)):
    want += np.bincount(source[i]["tokens"][source[i]["loss_mask"] != 0], minlength=64)
  np.testing.assert_array_equal(pipeline.token_counts(data, vocab_size=64), want)
