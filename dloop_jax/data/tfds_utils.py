"""TFDS helpers shared by the builders: local, array_record, no TensorFlow.

TFDS reads and writes array_record files without TensorFlow (examples are
serialized with its pure-protobuf `tf.train.Example`). Two things still need
care without TF and without network access:

  * `DatasetBuilder.code_path` probes `importlib_resources` for builders that
    live in a package; `LocalBuilder` returns its source file directly.
  * `download_and_prepare` would look for pre-built data on GCS;
    `no_network_download_config()` turns that off.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

FILE_FORMAT = "array_record"


def no_network_download_config() -> tfds.download.DownloadConfig:
  """A DownloadConfig for local builders: never look for prepared data on GCS."""
  return tfds.download.DownloadConfig(try_download_gcs=False)


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A GeneratorBasedBuilder defined in this package (not a TFDS catalog entry)."""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path | None:  # pylint: disable=invalid-overridden-method
    try:
      return epath.Path(inspect.getfile(cls))
    except (TypeError, OSError):
      return None


def find_dataset_dirs(root: str | os.PathLike, *, name: str) -> list[str]:
  """Version directories `root/<name>/<config>/<version>` of finished datasets."""
  root = os.fspath(root)
  found = []
  if os.path.isfile(os.path.join(root, "dataset_info.json")):
    return [root]
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("incomplete."))
    if "dataset_info.json" in filenames:
      with open(os.path.join(dirpath, "dataset_info.json")) as f:
        if json.load(f).get("name") == name:
          found.append(dirpath)
      dirnames[:] = []
  return found


def read_metadata(dataset_dir: str | os.PathLike) -> dict[str, Any]:
  """The `tfds.core.MetadataDict` a builder saved (`metadata.json`), or {}."""
  path = os.path.join(os.fspath(dataset_dir), "metadata.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def default_data_dir() -> str:
  """Where datasets go by default: $DLOOP_DATA_DIR, else <user cache>/dloop_jax/datasets.

  The user cache is $XDG_CACHE_HOME, or ~/.cache.
  """
  explicit = os.environ.get("DLOOP_DATA_DIR")
  if explicit:
    return os.path.expanduser(explicit)
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "dloop_jax", "datasets")
