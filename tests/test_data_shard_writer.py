"""Streaming array_record shards: several shards read back as the examples, in TFDS's order."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from dloop_jax.data import pipeline
from dloop_jax.data import shard_writer
from dloop_jax.data import chunk_cache
from dloop_jax.data import target_responses as tr
from dloop_jax.data import target_responses_config as tr_config
from dloop_jax.data import tfds_utils

tfds.disable_progress_bar()

# 14 random prompts, 3 chunks; 3 examples per shard -> 5 shards.
BUILD = dict(target="tiny", num_examples=14, seq_len=24, batch_size=4, chunk_size=8, seed=5,
             progress=False)


def _tensorflow_imported() -> bool:
  return any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  out_dir = str(tmp_path_factory.mktemp("sharded"))
  result = tr.build_target_responses(out_dir=out_dir, keep_work_dir=True, max_shard_examples=3,
                                     **BUILD)
  return out_dir, result


def _chunk_examples(work_dir):
  """Every example of the build's work chunks, by index (what the shards must hold)."""
  out = {}
  for name in sorted(os.listdir(work_dir)):
    if name.endswith(".npz"):
      with np.load(os.path.join(work_dir, name)) as z:
        arrays = {k: z[k] for k in z.files}
      offsets = np.concatenate([[0], np.cumsum(arrays["lengths"])])
      for row in range(len(arrays["index"])):
        e = chunk_cache.chunk_example(arrays, offsets, row)
        out[e["index"]] = e
  return out


def test_several_shards_read_back_as_the_chunks_in_tfds_order(sharded):
  out_dir, result = sharded
  names = sorted(n for n in os.listdir(result.dataset_dir) if ".array_record-" in n)
  assert names == [f"target_responses-train.array_record-{i:05d}-of-00005" for i in range(5)]
  builder = tfds.builder_from_directory(result.dataset_dir)
  split = builder.info.splits["train"]
  assert split.shard_lengths == [3, 3, 3, 3, 2] and split.num_bytes > 0
  source = builder.as_data_source(split="train")
  stored = [source[i] for i in range(len(source))]
  # The order TFDS's shuffling writer gives (hash of the key), which the
  # pipeline's seeded shuffle is applied to.
  assert [int(e["index"]) for e in stored] == shard_writer.tfds_order(range(14), split="train")
  expected = _chunk_examples(tr.default_work_dir(out_dir, result.config))
  assert len(expected) == 14
  for e in stored:
    want = expected[int(e["index"])]
    assert e["prompt_key"].decode() == want["prompt_key"]
    for key in ("tokens", "loss_mask", "features"):
      assert e[key].dtype == want[key].dtype
      np.testing.assert_array_equal(e[key], want[key])
    for key in ("prompt_len", "response_len", "stopped"):
      assert e[key] == want[key]
  assert not _tensorflow_imported()


def test_pipeline_reads_the_shards(sharded):
  _, result = sharded
  it = pipeline.make_train_iterator(path=result.dataset_dir, seq_len=24, batch_size=4, seed=0,
                                    shard_index=0, shard_count=1, num_epochs=1)
  batches = list(it)
  assert len(batches) == 3  # 14 examples, whole batches of 4
  assert batches[0]["tokens"].shape == (4, 24)
  assert batches[0]["features"].shape[:2] == (4, 24)
  assert not _tensorflow_imported()


def test_shard_bytes_bound(tmp_path):
  features = tfds.features.FeaturesDict({"x": tfds.features.Tensor(
      shape=(None,), dtype=np.float16, encoding=tfds.features.Encoding.BYTES)})
  template = tfds.core.ShardedFileTemplate(data_dir=tmp_path, dataset_name="toy", split="train",
                                           filetype_suffix="array_record")
  examples = [{"x": np.full((n,), n, np.float16)} for n in (300, 10, 300, 10, 10, 1000, 10)]
  info = shard_writer.write_split(examples, features=features, filename_template=template,
                                  max_shard_bytes=1000)
  # ~600 B + ~20 B | ~600 + 20 + 20 | ~2000 B alone (over the bound) | ~20 B.
  assert info.shard_lengths == [2, 3, 1, 1]
  assert info.num_bytes == sum(len(features.serialize_example(e)) for e in examples)
  assert sorted(os.listdir(tmp_path)) == [
      f"toy-train.array_record-{i:05d}-of-00004" for i in range(4)]
  with pytest.raises(ValueError, match="no example"):
    shard_writer.write_split([], features=features, filename_template=template)


def test_a_build_killed_while_writing_leaves_no_dataset(tmp_path, monkeypatch):
  out_dir = str(tmp_path)
  real = shard_writer.write_split

  def dies_after_a_shard(examples, **kw):
    def some():
      for i, e in enumerate(examples):
        if i == 4:
          raise KeyboardInterrupt  # as if killed mid-write
        yield e
    return real(some(), **kw)

  monkeypatch.setattr(shard_writer, "write_split", dies_after_a_shard)
  with pytest.raises(KeyboardInterrupt):
    tr.build_target_responses(out_dir=out_dir, max_shard_examples=3, **BUILD)
  assert tfds_utils.find_dataset_dirs(out_dir, name=tr_config.NAME) == []
  monkeypatch.setattr(shard_writer, "write_split", real)
  again = tr.build_target_responses(out_dir=out_dir, max_shard_examples=3, **BUILD)
  assert (again.chunks_reused, again.chunks_generated) == (2, 0)
  assert len(pipeline.data_source(again.dataset_dir)) == 14
