"""How the pieces of a training run are built: the target, drafter, loss and data hooks.

`TrainHooks` names one function per piece; `default_hooks()` uses the
library's own (`dloop_jax.drafters`, `dloop_jax.training.objectives`,
`dloop_jax.data.pipeline`), and `config.hooks` ("package.module:attribute")
plugs in others (tests, custom data).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dloop_jax import plain_values
from dloop_jax.errors import ConfigError

# `data.options` keys that shape the training rows, for every data source
# (`dloop_jax.data.pipeline.make_dataset`).
ITERATOR_OPTIONS = ("pack", "num_packing_bins")

@dataclasses.dataclass(frozen=True)
class Target:
  """The target a drafter is trained for."""

  model: Any  # dloop_jax.models.transformer.Transformer
  name: str
  tokenizer: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainHooks:
  """How the pieces of a run are built (the defaults use the library's own).

  Attributes:
    build_target: `(target_config) -> Target`.
    build_drafter: `(drafter_config: dict, *, target, rngs) -> Drafter`.
    loss_fn: `(drafter, batch, key, *, objective, cfg[, progress]) -> (loss, metrics)`;
      `progress` (fraction of training done, traced) is passed when it is a
      parameter.
    make_iterator: `(config, *, target: Target, drafter, workdir, batch_size,
      shard_index, shard_count) -> (iterator, data_info)`; the iterator yields
      dicts of numpy arrays with `batch_size` (per-process) rows and has
      `get_state()` / `set_state()`.
    check_dataset: `(data_info, *, drafter, target: Target) -> None`, raises
      ConfigError when the data does not fit the drafter (other taps, target).
    token_counts: `(data_info, *, vocab_size[, max_examples]) -> [vocab_size]
      counts` of the training tokens the drafter predicts; a fresh drafter
      with a reduced draft vocabulary uses the most frequent ones.
      `max_examples` is passed when `data.max_examples` is set.
    heldout_batches: `(config, *, data_info, batch_size, shard_index,
      shard_count) -> [batch]` the held-out examples (`data.heldout_examples`),
      one per row, each batch with "example" [rows] (-1: empty row); see
      `pipeline.heldout_batches`.

  With `data.online`, `check_dataset` is passed `online=True` when it takes
  that parameter (the taps are then the target's, not the data's).
  """

  build_target: Callable[..., Target]
  build_drafter: Callable[..., nnx.Module]
  loss_fn: Callable[..., tuple[jax.Array, Mapping[str, jax.Array]]]
  make_iterator: Callable[..., tuple[Iterator[Mapping[str, np.ndarray]], Any]]
  check_dataset: Callable[..., None]
  token_counts: Callable[..., np.ndarray] | None = None  # None: default_token_counts
  heldout_batches: Callable[..., list] | None = None  # None: default_heldout_batches


def default_build_target(target_config: Mapping[str, Any]) -> Target:
  """`config.target` -> Target: the tiny random target, or one `load_target` reads."""
  from dloop_jax.models.config import tiny_config  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import (  # pylint: disable=g-import-not-at-top
      Transformer, tiny_target_name)

  dtype = jnp.dtype(target_config["dtype"])
  if target_config["model"] == "tiny":
    overrides = plain_values.to_plain(target_config.get("overrides") or {})
    model = Transformer(tiny_config(**overrides), rngs=nnx.Rngs(int(target_config["seed"])),
                        dtype=dtype, init_std=float(target_config["init_std"]))
    return Target(model=model, name=tiny_target_name(
        seed=target_config["seed"], init_std=target_config["init_std"], **overrides))
  from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
  loaded = load_target(target_config["model"], dtype=dtype)
  return Target(model=loaded.model, name=loaded.name, tokenizer=loaded.tokenizer)


def library_function(module: str, name: str) -> Callable:
  """`module.name` of the library, or a ConfigError saying to plug in a hook instead."""
  try:
    return getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"{module}.{name} is not available ({e}); set config.hooks to a"
                      " TrainHooks providing it.") from e


def default_build_drafter(drafter_config, *, target, rngs):
  return library_function("dloop_jax.drafters", "build_drafter")(drafter_config, target=target,
                                                                 rngs=rngs)


def default_loss_fn(drafter, batch, key, *, objective, cfg, progress=None):
  return library_function("dloop_jax.training.objectives", "loss_fn")(
      drafter, batch, key, objective=objective, cfg=cfg, progress=progress)


def data_pipeline():
  """`dloop_jax.data.pipeline`, or a ConfigError saying which hook replaces it."""
  try:
    from dloop_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"The data pipeline dloop_jax.data.pipeline cannot be imported ({e}); set"
                      " config.hooks to a TrainHooks providing make_iterator.") from e
  return pipeline


def default_make_iterator(config, *, target: Target, drafter, workdir, batch_size,
                          shard_index, shard_count):
  """Grain iterator over a built dataset; tiny configs build theirs into the workdir.

  Returns (iterator, dataset path); the path is what `check_dataset_matches` inspects.
  """
  pipeline = data_pipeline()
  d = config.data
  options = plain_values.to_plain(d.options)
  # How rows are formed (every source); the other keys configure the tiny build.
  row_options = {k: options.pop(k) for k in ITERATOR_OPTIONS if k in options}
  if d.source == "tiny_random":
    path = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(path, "COMPLETE")):
      if jax.process_index() == 0:
        # The tiny target answers random prompts; the features are its taps.
        pipeline.build_target_responses(
            target=target.model, target_name=target.name, taps=tuple(drafter.taps),
            out_dir=path, num_examples=int(d.num_examples), seq_len=int(d.seq_len),
            seed=int(d.shuffle_seed), **options)
        with open(os.path.join(path, "COMPLETE"), "w") as f:
          f.write("ok\n")
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("dloop_tiny_data")
  elif d.source == "path":
    if not d.path:
      raise ConfigError("data.source='path' needs data.path: a dataset built with"
                        " `python -m train.data`.")
    path = d.path
    if options:
      raise ConfigError(f"data.options {sorted(options)} only configure the tiny_random build;"
                        f" with data.source='path' the options are {list(ITERATOR_OPTIONS)}.")
  else:
    raise ConfigError(f"data.source must be 'tiny_random' or 'path', got {d.source!r}.")
  iterator = pipeline.make_train_iterator(
      path=path, batch_size=batch_size, seq_len=int(d.seq_len), seed=int(d.shuffle_seed),
      shard_index=shard_index, shard_count=shard_count, worker_count=int(d.worker_count),
      max_examples=int(d.max_examples), heldout_examples=int(d.heldout_examples),
      features=not d.online, **row_options)
  return iterator, path


def default_check_dataset(data_info, *, drafter, target: Target, online: bool = False):
  """Raises ConfigError unless the dataset fits; `online`: its tokens only (not its taps)."""
  data_pipeline().check_dataset_matches(data_info, taps=None if online else tuple(drafter.taps),
                                    target_config=target.model.config,
                                    target_name=None if online else target.name)


def default_heldout_batches(config, *, data_info, batch_size: int, shard_index: int,
                            shard_count: int) -> list[dict[str, np.ndarray]]:
  """The run's held-out examples (`data.heldout_examples`) as padded batches."""
  if not isinstance(data_info, (str, os.PathLike)):
    raise ConfigError("data.heldout_examples needs the dataset's path from the data hook; it"
                      f" returned {type(data_info).__name__}: set TrainHooks.heldout_batches.")
  d = config.data
  return data_pipeline().heldout_batches(
      path=data_info, seq_len=int(d.seq_len), batch_size=batch_size,
      heldout_examples=int(d.heldout_examples), shard_index=shard_index,
      shard_count=shard_count, features=not d.online)


def default_token_counts(data_info, *, vocab_size: int, max_examples: int = 0) -> np.ndarray:
  """Response-token counts of the training split of the dataset at `data_info` (a path).

  `max_examples`: count the examples the run trains on (`data.max_examples`).
  """
  if not isinstance(data_info, (str, os.PathLike)):
    raise ConfigError("A drafter with a reduced draft vocabulary needs the token counts of its"
                      f" training data; the data hook returned {type(data_info).__name__}, not"
                      " a dataset path: set TrainHooks.token_counts.")
  return data_pipeline().token_counts(data_info, vocab_size=vocab_size, max_examples=max_examples)


def default_hooks() -> TrainHooks:
  return TrainHooks(build_target=default_build_target, build_drafter=default_build_drafter,
                    loss_fn=default_loss_fn, make_iterator=default_make_iterator,
                    check_dataset=default_check_dataset, token_counts=default_token_counts)


def load_hooks(spec: str) -> TrainHooks:
  """`"package.module:attribute"` -> TrainHooks (or a function returning one)."""
  if not spec:
    return default_hooks()
  module_name, _, attr = spec.partition(":")
  try:
    obj = getattr(importlib.import_module(module_name), attr or "HOOKS")
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"config.hooks={spec!r} cannot be imported ({e}); expected"
                      " 'package.module:attribute' of a TrainHooks.") from e
  hooks = obj() if callable(obj) and not isinstance(obj, TrainHooks) else obj
  if not isinstance(hooks, TrainHooks):
    raise ConfigError(f"config.hooks={spec!r} is a {type(hooks).__name__}, not a TrainHooks.")
  return hooks

