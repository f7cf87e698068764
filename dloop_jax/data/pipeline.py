"""Grain input pipeline over a built `target_responses` dataset.

    it = make_train_iterator(path=DIR, seq_len=T, batch_size=B, seed=0,
                             shard_index=jax.process_index(),
                             shard_count=jax.process_count(),
                             pack=False, num_epochs=None)
    batch = next(it)             # dict of numpy arrays, see below
    state = it.get_state()       # JSON-able; the trainer saves it with Orbax
    it.set_state(state)          # resume exactly there

`path` is the dataset's version directory (`<data_dir>/target_responses/<config>/1.0.0`)
or a data_dir holding exactly one target_responses dataset.

Stages:

    MapDataset.source(TFDS array_record data source)
      pack=False (padded rows):
      -> shuffle(seed), reshuffled every epoch -> repeat(num_epochs; None = forever)
      -> truncate and pad to seq_len
      -> this process's rows of each global batch (`process_rows`): the global
         batches are the same for any process count, so a pod run computes
         what one process with as many devices would
      pack=True (first-fit packed rows):
      -> per-process shard: examples [shard_index::shard_count] of the first
         shard_count * floor(N / shard_count) (every process gets the same
         number of examples, so multi-host steps stay in lockstep); which
         examples share a row depends on the process count
      -> shuffle(seed), reshuffled every epoch -> repeat(num_epochs)
      -> truncate to seq_len -> first-fit pack several examples per row
      -> batch(batch_size, drop_remainder=True)
      -> iterator

Batch (B = batch_size rows of this process, T = seq_len):

    tokens       [B, T] int32                 prompt + response, 0 at padding
    loss_mask    [B, T] int32                 1 where tokens[t] is a response token
                                              (what the drafter must predict)
    features     [B, T, n_taps, D] float16    target taps after reading tokens[t]
                                              (0 at padding and at each example's
                                              last token)
    segment_ids  [B, T] int32                 1, 2, ... per packed example; 0 = padding
    positions    [B, T] int32                 position within its own example (0 at padding)

and, from datasets built with `target_topk` = k (`TOPK_KEYS`):

    target_topk_ids    [B, T, k] int32        the target's k likeliest next tokens after
    target_topk_probs  [B, T, k] float16      reading tokens[t], and their probabilities
                                              (0 at padding and at each example's last token)

Examples longer than seq_len lose their tail (the loss mask with it). In
packed rows a prediction never crosses examples: each example starts with its
prompt, whose loss mask is 0; objectives that look further back must mask by
`segment_ids`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from dloop_jax.data import target_responses as tr_lib
from dloop_jax.data import target_responses_config as tr_config
from dloop_jax.data import tfds_utils
from dloop_jax.errors import ConfigError

BATCH_KEYS = ("tokens", "loss_mask", "features", "segment_ids", "positions")
# What a batch holds with features=False (online training).
TOKEN_BATCH_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")
TOPK_KEYS = tr_config.TOPK_KEYS
_SEQUENCE_KEYS = ("tokens", "loss_mask", "features")
# What online training reads of an example (the target computes the rest).
TOKEN_KEYS = ("tokens", "loss_mask")
_DTYPES = {"tokens": np.int32, "loss_mask": np.int32, "features": np.float16,
           "target_topk_ids": np.int32, "target_topk_probs": np.float16}

# Re-exported: trainer configs call it to make tiny data on the fly.
build_target_responses = tr_lib.build_target_responses


# ------------------------------------------------------------------ finding
def resolve_dataset_dir(path: str | os.PathLike) -> str:
  """The version directory of the target_responses dataset at / under `path`."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ConfigError(f"Dataset path {path!r} does not exist; build one with"
                      " `python -m train.data --config configs/data_<name>.py`.")
  found = tfds_utils.find_dataset_dirs(path, name=tr_config.NAME)
  if not found:
    raise ConfigError(f"{path!r} holds no finished {tr_config.NAME} dataset (no"
                      " dataset_info.json); build one with `python -m train.data`.")
  if len(found) > 1:
    listing = "\n  ".join(found)
    raise ConfigError(f"{path!r} holds {len(found)} {tr_config.NAME} datasets; pass one of:\n"
                      f"  {listing}")
  return found[0]


def dataset_metadata(info: Any) -> dict[str, Any]:
  """Metadata of a dataset given its path, a `tfds.core.DatasetInfo` or the dict itself."""
  if isinstance(info, Mapping):
    return dict(info)
  if isinstance(info, (str, os.PathLike)):
    return tfds_utils.read_metadata(resolve_dataset_dir(info))
  metadata = getattr(info, "metadata", None)
  if metadata:
    return dict(metadata)
  data_dir = getattr(info, "data_dir", None)
  return tfds_utils.read_metadata(data_dir) if data_dir else {}


def check_dataset_matches(info: Any, *, taps, target_fingerprint: Mapping[str, Any] | None = None,
                          target_config: Any = None, target_name: str | None = None) -> None:
  """Raises ConfigError unless the dataset holds features of these taps of this target.

  Args:
    info: dataset path, `tfds.core.DatasetInfo`, or its metadata dict.
    taps: the layers the drafter reads (None: not checked; online training
      computes them).
    target_fingerprint: `TransformerConfig.fingerprint` of the target.
    target_config: alternatively the `TransformerConfig` (its fingerprint is used).
    target_name: the target's name; checked when given (same shapes, other
      weights would give other features).
  """
  meta = dataset_metadata(info)
  where = info if isinstance(info, (str, os.PathLike)) else "the dataset"
  if not meta or "taps" not in meta:
    raise ConfigError(f"{where} has no {tr_config.NAME} metadata (taps, target); rebuild it with"
                      " `python -m train.data`.")
  have = tuple(int(t) for t in meta["taps"])
  want = have if taps is None else tuple(int(t) for t in taps)
  if have != want:
    raise ConfigError(f"{where} holds target features of layers {have}; the drafter reads"
                      f" layers {want}. Rebuild the dataset with taps={list(want)}.")
  if target_fingerprint is None and target_config is not None:
    target_fingerprint = target_config.fingerprint
  if target_fingerprint is not None:
    recorded = dict(meta.get("target_fingerprint") or {})
    if recorded != dict(target_fingerprint):
      raise ConfigError(f"{where} was built with a target of shape {recorded}; this target is"
                        f" {dict(target_fingerprint)}. Rebuild the dataset with this target.")
  if target_name is not None and meta.get("target_name") not in (None, target_name):
    raise ConfigError(f"{where} was built with target {meta['target_name']!r}; this run uses"
                      f" {target_name!r}. Rebuild the dataset with this target.")


def data_source(path: str | os.PathLike, *, split: str = tr_config.TRAIN, features: bool = True):
  """The random-access TFDS data source (array_record) of a split.

  `features=False`: the stored target outputs (taps, top-k) are left
  undecoded (online training reads token ids only).
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder_from_directory(resolve_dataset_dir(path))
  if split not in builder.info.splits:
    raise ConfigError(f"The dataset has splits {list(builder.info.splits)}, not {split!r}.")
  if features:
    return builder.as_data_source(split=split)
  skipped = {k: tfds.decode.SkipDecoding() for k in ("features",) + TOPK_KEYS
             if k in builder.info.features}
  return builder.as_data_source(split=split, decoders=skipped)


def token_counts(path: str | os.PathLike, *, vocab_size: int, split: str = tr_config.TRAIN,
                 masked: bool = True, max_examples: int = 0) -> np.ndarray:
  """[V] int64 counts of the target tokens of a split, in one pass over its examples.

  `masked` counts only response tokens (`loss_mask` 1): what a drafter
  predicts; prompts are inputs only. Whole examples are counted, also beyond
  a training `seq_len`; with `max_examples` only the split's first N (the
  examples `make_dataset(max_examples=N)` trains on). The `features` field
  (almost all of each record) is left undecoded.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder_from_directory(resolve_dataset_dir(path))
  if split not in builder.info.splits:
    raise ConfigError(f"The dataset has splits {list(builder.info.splits)}, not {split!r}.")
  source = builder.as_data_source(split=split,
                                  decoders={"features": tfds.decode.SkipDecoding()})
  counts = np.zeros((vocab_size,), np.int64)
  for i in range(min(len(source), max_examples) if max_examples else len(source)):
    example = source[i]
    tokens = np.asarray(example["tokens"])
    if masked:
      tokens = tokens[np.asarray(example["loss_mask"]) != 0]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
      raise ConfigError(f"The dataset holds token ids {tokens.min()}..{tokens.max()}, outside"
                        f" this target's vocabulary [0, {vocab_size}).")
    counts += np.bincount(tokens, minlength=vocab_size)
  return counts


# --------------------------------------------------------------- transforms
def _sequence_keys(example: Mapping[str, Any], features: bool = True) -> tuple[str, ...]:
  if not features:
    return TOKEN_KEYS
  return _SEQUENCE_KEYS + tuple(k for k in TOPK_KEYS if k in example)


def _truncated(example: Mapping[str, Any], seq_len: int,
               features: bool = True) -> dict[str, np.ndarray]:
  missing = [k for k in TOKEN_KEYS if k not in example]
  if missing:
    raise ConfigError(f"The dataset's examples lack {missing} (they hold {sorted(example)}):"
                      " training needs token ids and a loss mask.")
  n = min(len(example["tokens"]), seq_len)
  return {key: np.asarray(example[key][:n], _DTYPES[key])
          for key in _sequence_keys(example, features)}


def _padded(example: Mapping[str, Any], seq_len: int, features: bool = True
            ) -> dict[str, np.ndarray]:
  x = _truncated(example, seq_len, features)
  n = len(x["tokens"])
  out = {}
  for key in _sequence_keys(x, features):
    value = x[key]
    out[key] = np.zeros((seq_len,) + value.shape[1:], value.dtype)
    out[key][:n] = value
  out["segment_ids"] = (np.arange(seq_len) < n).astype(np.int32)
  out["positions"] = np.where(np.arange(seq_len) < n, np.arange(seq_len), 0).astype(np.int32)
  return out


def _from_packed(x: Mapping[str, np.ndarray], features: bool = True) -> dict[str, np.ndarray]:
  out = {key: x[key].astype(_DTYPES[key]) for key in _sequence_keys(x, features)}
  out.update(segment_ids=x["tokens_segment_ids"].astype(np.int32),
             positions=x["tokens_positions"].astype(np.int32))
  return out


# ----------------------------------------------------------------- pipeline
def make_dataset(
    *,
    path: str | os.PathLike,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shard_index: int | None = None,
    shard_count: int | None = None,
    pack: bool = False,
    num_epochs: int | None = None,
    split: str = tr_config.TRAIN,
    num_packing_bins: int | None = None,
    worker_count: int = 0,
    max_examples: int = 0,
    heldout_examples: int = 0,
    features: bool = True,
    source: Any = None,
) -> grain.IterDataset:
  """The pipeline as a Grain `IterDataset` (`make_train_iterator` iterates it).

  Args:
    path: dataset version directory, or a data_dir holding one dataset.
    seq_len: T, tokens per row.
    batch_size: rows per batch of this process.
    seed: shuffling (and bin shuffling when packing).
    shard_index / shard_count: this process's shard (default
      `jax.process_index()` / `jax.process_count()`).
    pack: first-fit pack several examples per row instead of padding each.
    num_epochs: passes over the data (None = repeat forever).
    split: dataset split.
    num_packing_bins: rows packed at a time (default batch_size).
    worker_count: Grain worker processes (0 = in this process).
    max_examples: train on the split's first N examples only (0 = all): nested
      subsets of one dataset (data-scaling runs), the same N for every process.
    heldout_examples: the split's last N examples are held out (never
      trained on; `heldout_batches` reads them).
    features: False = token ids, loss mask, segments and positions only (online
      training: the target computes the rest in the train step).
    source: a random-access source to use instead of `path` (tests).
  """
  if shard_index is None or shard_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= shard_index < shard_count:
    raise ConfigError(f"shard_index must be in [0, {shard_count}), got {shard_index}.")
  if seq_len < 2 or batch_size < 1:
    raise ConfigError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len}, {batch_size}.")
  if num_epochs is not None and num_epochs < 1:
    raise ConfigError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}.")
  if max_examples < 0:
    raise ConfigError(f"max_examples must be >= 0 (0 = every example), got {max_examples}.")
  src = source if source is not None else data_source(path, split=split, features=features)
  ds = grain.MapDataset.source(src)
  ds = ds[:_trainable(len(ds), heldout_examples=heldout_examples, split=split)]
  if max_examples:
    if max_examples > len(ds):
      raise ConfigError(f"max_examples={max_examples} but the {split!r} split holds {len(ds)}"
                        f" examples{' besides the held-out ones' if heldout_examples else ''};"
                        " build a larger dataset or lower max_examples.")
    ds = ds[:max_examples]
  if pack:
    n = len(ds) - len(ds) % shard_count
    if n == 0:
      raise ConfigError(f"The dataset has {len(ds)} examples, fewer than the {shard_count}"
                        " processes that share it.")
    ds = ds[:n][shard_index::shard_count].shuffle(seed=seed).repeat(num_epochs)
    keys = _sequence_keys(src[0], features)
    ds = ds.map(lambda x: _truncated(x, seq_len, features)).to_iter_dataset()
    lengths = {k: seq_len for k in keys}
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=num_packing_bins or batch_size,
        seed=seed, shuffle_bins=True)
    ds = ds.map(lambda x: _from_packed(x, features)).batch(batch_size, drop_remainder=True)
  else:
    ds = ds.shuffle(seed=seed).repeat(num_epochs).map(lambda x: _padded(x, seq_len, features))
    ds = process_rows(ds, batch_size=batch_size, shard_index=shard_index,
                      shard_count=shard_count).to_iter_dataset()
  if worker_count > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return ds


def _trainable(n: int, *, heldout_examples: int, split: str) -> int:
  """How many of a split's n examples training reads (the rest are held out)."""
  if heldout_examples < 0:
    raise ConfigError(f"heldout_examples must be >= 0, got {heldout_examples}.")
  if heldout_examples >= n:
    raise ConfigError(f"heldout_examples={heldout_examples} but the {split!r} split holds {n}"
                      " examples: leave some to train on.")
  return n - heldout_examples


def heldout_batches(*, path: str | os.PathLike, seq_len: int, batch_size: int,
                    heldout_examples: int, shard_index: int = 0, shard_count: int = 1,
                    split: str = tr_config.TRAIN, features: bool = True,
                    source: Any = None) -> list[dict[str, np.ndarray]]:
  """The held-out examples (the split's last N, never trained on) as padded batches.

  One example per row, in the split's order; the last batch is completed with
  empty rows (segment 0, loss mask 0: they count nowhere). Batch g holds rows
  [g * batch_size, (g + 1) * batch_size) of the held-out examples; this
  process reads its share of them, as training batches are split.

  Returns:
    Batches as `make_dataset` yields them (this process's rows), each with
    "example" [rows] int32: the held-out example index of each row (-1 for
    the empty ones).
  """
  if batch_size % shard_count:
    raise ConfigError(f"The held-out batch of {batch_size} rows does not split over"
                      f" {shard_count} processes.")
  src = source if source is not None else data_source(path, split=split, features=features)
  n = len(src)
  first = _trainable(n, heldout_examples=heldout_examples, split=split)
  rows = batch_size // shard_count
  empty = {k: np.zeros_like(v) for k, v in _padded(src[first], seq_len, features).items()}
  out = []
  for start in range(0, heldout_examples, batch_size):
    lo = start + shard_index * rows
    examples = [(i, _padded(src[first + i], seq_len, features)) if i < heldout_examples
                else (-1, empty) for i in range(lo, lo + rows)]
    batch = {k: np.stack([x[k] for _, x in examples]) for k in examples[0][1]}
    batch["example"] = np.asarray([i for i, _ in examples], np.int32)
    out.append(batch)
  return out


def process_rows(ds: grain.MapDataset, *, batch_size: int, shard_index: int,
                 shard_count: int) -> grain.MapDataset:
  """This process's rows of every global batch of a (shuffled) example stream.

  Global batch b is examples [b * G, (b + 1) * G) of `ds`, G = shard_count *
  batch_size; process i gets its rows [i * batch_size, (i + 1) * batch_size),
  so the global batch, and with it every loss and update, is the same for any
  number of processes. Only those rows are read (random access).

  Args:
    ds: examples in training order (already shuffled and repeated).
    batch_size: rows per batch of this process.
    shard_index / shard_count: this process and the process count.

  Returns:
    A MapDataset of batches (dicts of [batch_size, ...] arrays).
  """
  blocks = ds.batch(batch_size, drop_remainder=True)
  # Whole global batches only: every process takes as many steps.
  usable = len(blocks) - len(blocks) % shard_count
  if usable == 0:
    raise ConfigError(f"The dataset has {len(ds)} examples, fewer than one global batch of"
                      f" {shard_count} x {batch_size}.")
  return blocks[:usable][shard_index::shard_count]


def make_train_iterator(
    *,
    path: str | os.PathLike,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shard_index: int | None = None,
    shard_count: int | None = None,
    pack: bool = False,
    num_epochs: int | None = None,
    **kwargs,
) -> grain.DatasetIterator:
  """`iter(make_dataset(...))`: a Grain iterator with `get_state` / `set_state`.

  Arguments as `make_dataset` (`split`, `num_packing_bins`, `worker_count`,
  `source` pass through).
  """
  return iter(make_dataset(path=path, seq_len=seq_len, batch_size=batch_size, seed=seed,
                           shard_index=shard_index, shard_count=shard_count, pack=pack,
                           num_epochs=num_epochs, **kwargs))
