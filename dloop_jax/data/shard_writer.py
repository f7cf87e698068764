"""Streams a split's examples straight into array_record shards (no TensorFlow).

TFDS's own writer (`SplitBuilder` -> `ExampleWriter`) first collects a whole
split in a shuffler: in memory up to 1 GB, then in disk buckets written through
`tf.io.gfile`, which needs TensorFlow. Splits of hidden-state features pass
1 GB after a few hundred examples, so builders with large splits write their
shards here instead: every example is serialized with the dataset's
`FeaturesDict` and appended to the current shard as soon as it arrives; a shard
is closed when it would pass `max_shard_bytes` (or `max_shard_examples`).

The files and the `SplitInfo` are the ones TFDS would produce
(`{name}-{split}.array_record-XXXXX-of-YYYYY`, shard lengths, bytes), so
`tfds.builder`, `tfds.data_source` and grain read the result unchanged. The
builder writes into TFDS's temporary `incomplete.*` directory, renamed only
once the dataset info is written: a killed build never leaves a dataset that
loads.

Order: TFDS stores a shuffled split sorted by the hash of each example's key
(salted with the split name); `tfds_order` gives that order, so a builder that
yields its examples in it writes the same dataset TFDS's writer would.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds
from tensorflow_datasets.core import hashing
from array_record.python import array_record_module

# TFDS writes its array_record shards with these options (random access per record).
_WRITER_OPTIONS = "group_size:1"
DEFAULT_MAX_SHARD_BYTES = 1 << 30


def tfds_order(keys: Iterable[Hashable], *, split: str) -> list[Hashable]:
  """`keys` in the order TFDS's shuffling writer stores their examples."""
  hasher = hashing.Hasher(split)
  return sorted(keys, key=hasher.hash_key)


def write_split(
    examples: Iterable[Mapping[str, Any]],
    *,
    features: tfds.features.FeaturesDict,
    filename_template: tfds.core.ShardedFileTemplate,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    max_shard_examples: int | None = None,
) -> tfds.core.SplitInfo:
  """Writes `examples`, in the given order, as sharded array_record files.

  Args:
    examples: feature dicts (what `features.encode_example` takes).
    features: the dataset's features.
    filename_template: where and under which names (the builder's
      `_get_filename_template(split)`; its split names the split).
    max_shard_bytes: a shard is closed before it would pass this size (a
      single larger example still gets a shard of its own).
    max_shard_examples: and after this many examples (None: no limit).

  Returns:
    The split's `SplitInfo` (shard lengths and bytes), for `info.set_splits`.
  """
  if max_shard_bytes < 1 or (max_shard_examples is not None and max_shard_examples < 1):
    raise ValueError(f"Shard limits must be >= 1, got max_shard_bytes={max_shard_bytes},"
                     f" max_shard_examples={max_shard_examples}.")
  directory = os.fspath(filename_template.data_dir)
  os.makedirs(directory, exist_ok=True)
  # Final names need the shard count, known at the end: write under
  # temporary names, rename when done.
  prefix = os.path.join(directory, f"{filename_template.dataset_name}-{filename_template.split}"
                        f".{filename_template.filetype_suffix}-writing-")
  paths: list[str] = []
  lengths: list[int] = []
  sizes: list[int] = []
  writer = None
  for example in examples:
    record = features.serialize_example(example)
    full = writer is not None and (
        sizes[-1] + len(record) > max_shard_bytes
        or (max_shard_examples is not None and lengths[-1] >= max_shard_examples))
    if writer is None or full:
      if writer is not None:
        writer.close()
      paths.append(f"{prefix}{len(paths):05d}")
      writer = array_record_module.ArrayRecordWriter(paths[-1], _WRITER_OPTIONS)
      lengths.append(0)
      sizes.append(0)
    writer.write(record)
    lengths[-1] += 1
    sizes[-1] += len(record)
  if writer is None:
    raise ValueError(f"Split {filename_template.split!r} has no example to write.")
  writer.close()
  for i, path in enumerate(paths):
    os.replace(path, filename_template.sharded_filepath(shard_index=i, num_shards=len(paths)))
  # num_bytes counts serialized examples, as TFDS's writer does (not file sizes).
  return tfds.core.SplitInfo(name=filename_template.split, shard_lengths=lengths,
                             num_bytes=sum(sizes), filename_template=filename_template)


def split_infos_for(builder: tfds.core.DatasetBuilder,
                    split_examples: Mapping[str, Iterable[Mapping[str, Any]]],
                    **limits) -> Sequence[tfds.core.SplitInfo]:
  """`write_split` for every split of `builder` (in its temporary data path)."""
  return [write_split(examples, features=builder.info.features,
                      filename_template=builder._get_filename_template(split_name=split),  # pylint: disable=protected-access
                      **limits)
          for split, examples in split_examples.items()]
