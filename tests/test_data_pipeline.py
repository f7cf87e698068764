"""Grain pipeline: batch contract, pad / pack, seeded shuffle, resumable state, shards."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from dloop_jax.data import pipeline
from dloop_jax.errors import ConfigError
from dloop_jax.models.transformer import tiny_target

tfds.disable_progress_bar()

SEQ_LEN = 40


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  """30 random prompts (4..8 tokens) answered by a tiny target (12..20 tokens each)."""
  out_dir = str(tmp_path_factory.mktemp("pipe"))
  result = pipeline.build_target_responses(
      out_dir=out_dir, target="tiny", target_seed=0, num_examples=30, max_new_tokens=12,
      random_prompt_max_len=8, batch_size=8, chunk_size=16, progress=False)
  source = pipeline.data_source(result.dataset_dir)
  examples = {int(source[i]["index"]): source[i] for i in range(len(source))}
  return out_dir, examples


def _it(out_dir, **kw):
  args = dict(path=out_dir, seq_len=SEQ_LEN, batch_size=4, seed=7, shard_index=0, shard_count=1)
  args.update(kw)
  return pipeline.make_train_iterator(**args)


def _rows(batch):
  """Per row, per segment: the token tuple (identifies its example)."""
  out = []
  for b in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][b]
    for s in sorted(set(seg.tolist()) - {0}):
      out.append(tuple(batch["tokens"][b][seg == s].tolist()))
  return out


def _by_tokens(examples):
  return {tuple(e["tokens"].tolist()): e for e in examples.values()}


def test_padded_batch_contract(dataset):
  out_dir, examples = dataset
  batch = next(_it(out_dir))
  d = tiny_target(seed=0).config.hidden_size
  assert set(batch) == set(pipeline.BATCH_KEYS)
  assert batch["tokens"].shape == (4, SEQ_LEN) and batch["tokens"].dtype == np.int32
  assert batch["features"].shape == (4, SEQ_LEN, 2, d) and batch["features"].dtype == np.float16
  for key in ("loss_mask", "segment_ids", "positions"):
    assert batch[key].dtype == np.int32
  by_tokens = _by_tokens(examples)
  for b in range(4):
    n = int((batch["segment_ids"][b] == 1).sum())
    e = by_tokens[tuple(batch["tokens"][b, :n].tolist())]
    np.testing.assert_array_equal(batch["loss_mask"][b, :n], e["loss_mask"])
    np.testing.assert_array_equal(batch["features"][b, :n], e["features"])
    assert batch["positions"][b, :n].tolist() == list(range(n))
    for key in pipeline.BATCH_KEYS:
      assert not batch[key][b, n:].any()  # zeros at padding
  assert "tensorflow" not in sys.modules


def test_truncates_long_examples(dataset):
  out_dir, _ = dataset
  batch = next(_it(out_dir, seq_len=10))
  assert batch["tokens"].shape == (4, 10) and (batch["segment_ids"] == 1).all()


def test_packed_batches(dataset):
  out_dir, examples = dataset
  by_tokens = _by_tokens(examples)
  it = _it(out_dir, pack=True)
  packed_any = False
  for _ in range(3):
    batch = next(it)
    for b in range(4):
      seg = batch["segment_ids"][b]
      ids = sorted(set(seg.tolist()) - {0})
      packed_any |= len(ids) > 1
      assert ids == list(range(1, len(ids) + 1))
      for s in ids:
        where = seg == s
        e = by_tokens[tuple(batch["tokens"][b][where].tolist())]
        assert batch["positions"][b][where].tolist() == list(range(len(e["tokens"])))
        np.testing.assert_array_equal(batch["loss_mask"][b][where], e["loss_mask"])
        np.testing.assert_array_equal(batch["features"][b][where], e["features"])
        assert e["loss_mask"][0] == 0  # each example starts with its prompt
      assert not batch["features"][b][seg == 0].any()
  assert packed_any


@pytest.mark.parametrize("pack", [False, True])
def test_state_restore_gives_identical_batches(dataset, pack):
  out_dir, _ = dataset
  straight = _it(out_dir, pack=pack)
  reference = [next(straight) for _ in range(12)]  # 12 * 4 > 30: crosses an epoch
  it = _it(out_dir, pack=pack)
  for _ in range(5):
    next(it)
  state = it.get_state()
  restored = _it(out_dir, pack=pack)
  restored.set_state(state)
  for want in reference[5:]:
    got = next(restored)
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], want[key])


def test_seeded_shuffle_and_epochs(dataset):
  out_dir, examples = dataset
  one = [r for b in _it(out_dir, seed=1, num_epochs=1) for r in _rows(b)]
  same = [r for b in _it(out_dir, seed=1, num_epochs=1) for r in _rows(b)]
  other = [r for b in _it(out_dir, seed=2, num_epochs=1) for r in _rows(b)]
  assert one == same and one != other
  assert len(one) == 28 and len(set(one)) == 28  # 30 // 4 batches, no repeats in an epoch
  two = [r for b in _it(out_dir, seed=1, num_epochs=2, batch_size=5) for r in _rows(b)]
  assert len(two) == 60 and two[:30] != two[30:] and set(two[:30]) == set(two[30:])


def test_two_processes_see_disjoint_shards(dataset):
  out_dir, examples = dataset
  batches = [list(_it(out_dir, shard_index=i, shard_count=2, batch_size=3, num_epochs=1))
             for i in range(2)]
  shards = [[r for b in bs for r in _rows(b)] for bs in batches]
  assert len(shards[0]) == len(shards[1]) == 15
  assert not set(shards[0]) & set(shards[1])
  assert set(shards[0]) | set(shards[1]) == set(_by_tokens(examples))
  # Together they are the batches of one process with the global batch size.
  one = list(_it(out_dir, shard_index=0, shard_count=1, batch_size=6, num_epochs=1))
  assert len(one) == len(batches[0]) == len(batches[1]) == 5
  for whole, first, second in zip(one, *batches):
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(whole[key], np.concatenate([first[key], second[key]]))
  with pytest.raises(ConfigError, match="shard_index"):
    _it(out_dir, shard_index=2, shard_count=2)


def test_trainer_contract(tmp_path):
  """The calls the trainer's default data hook makes, in its order."""
  model = tiny_target(seed=1)
  path = str(tmp_path / "data")
  pipeline.build_target_responses(
      target=model, target_name="tiny(seed=1,init_std=0.3)", taps=(0, 1), out_dir=path,
      num_examples=8, seq_len=32, seed=0, progress=False)
  it = pipeline.make_train_iterator(path=path, batch_size=2, seq_len=32, seed=0, shard_index=0,
                                    shard_count=1, worker_count=0)
  batch = next(it)
  assert batch["tokens"].shape == (2, 32)
  # Prompts up to seq_len // 4, responses the rest: examples fit seq_len.
  source = pipeline.data_source(path)
  assert max(len(source[i]["tokens"]) for i in range(len(source))) <= 32
  pipeline.check_dataset_matches(path, taps=(0, 1), target_config=model.config,
                                 target_name="tiny(seed=1,init_std=0.3)")
  assert os.path.isdir(pipeline.resolve_dataset_dir(path))


@pytest.mark.parametrize("pack", [False, True])
def test_max_examples_trains_on_the_first_n(dataset, pack):
  """Nested subsets for data-scaling runs: the first N examples of the split, counted alike."""
  out_dir, _ = dataset
  source = pipeline.data_source(out_dir)
  first = {tuple(np.asarray(source[i]["tokens"]).tolist()) for i in range(12)}
  rows = [r for b in _it(out_dir, max_examples=12, num_epochs=2, pack=pack) for r in _rows(b)]
  assert rows and set(rows) <= first  # examples fit SEQ_LEN: none is cut
  if not pack:  # 12 = 3 batches of 4: each epoch holds every example once
    assert len(rows) == 24 and set(rows) == first
  counts = pipeline.token_counts(out_dir, vocab_size=128, max_examples=12)
  masked = np.concatenate([np.asarray(source[i]["tokens"])[np.asarray(source[i]["loss_mask"]) != 0]
                           for i in range(12)])
  np.testing.assert_array_equal(counts, np.bincount(masked, minlength=128))
  with pytest.raises(ConfigError, match="max_examples=31 but the 'train' split holds 30"):
    _it(out_dir, max_examples=31)
  with pytest.raises(ConfigError, match="max_examples must be >= 0"):
    _it(out_dir, max_examples=-1)


def test_trainer_forms_packed_rows_from_a_dataset_path(dataset, tmp_path):
  """`data.options.pack` reaches the pipeline for built datasets; tiny-build keys are refused."""
  from ml_collections import ConfigDict  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import hooks as hooks_lib  # pylint: disable=g-import-not-at-top
  out_dir, _ = dataset
  c = config_lib.base_config()
  c.data.source, c.data.path, c.data.seq_len = "path", out_dir, SEQ_LEN
  c.data.options = ConfigDict(dict(pack=True))
  hook = dict(target=None, drafter=None, workdir=str(tmp_path), batch_size=4, shard_index=0,
              shard_count=1)
  batch = next(hooks_lib.default_make_iterator(c, **hook)[0])
  # Examples of 5..20 tokens in rows of 40: packing puts several in a row.
  assert batch["segment_ids"].max() >= 2
  c.data.options = ConfigDict(dict(pack=True, random_prompt_max_len=8))
  with pytest.raises(ConfigError, match=r"\['random_prompt_max_len'\] only configure the tiny"):
    hooks_lib.default_make_iterator(c, **hook)
