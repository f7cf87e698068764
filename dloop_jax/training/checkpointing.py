"""Training checkpoints with an Orbax `CheckpointManager`.

A checkpoint of step N (N optimizer updates done) is one Orbax step directory
with these items:

    params       {flat name: array}   trainable drafter weights (nnx.Param)
    opt_state    optax state           moments shaped and sharded like params
    model_state  {flat name: array}   other non-frozen drafter variables (if any)
    data_iter    per-process JSON      Grain iterator state after N batches
    meta         JSON                  step, drafter kind / config, target, run config

Saves are asynchronous: `save()` returns once the arrays are copied to host,
the files are written in the background, and the step directory only appears
(renamed from `<N>.orbax-checkpoint-tmp-*`) once everything is on disk. A
process killed mid-save leaves a temporary directory that the next start
deletes. Restores read into an abstract target carrying each array's
`NamedSharding`, so every device reads only its own shards.

A step directory that fails to restore (truncated or corrupted files) is moved
aside to `corrupt-<N>-<time>` with a warning and the previous step is tried.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from dloop_jax.errors import DLoopError

_ARRAY_ITEMS = ("params", "opt_state", "model_state")


class CheckpointError(DLoopError, OSError):
  """No usable checkpoint where one was expected."""


def error_summary(e: BaseException, limit: int = 400) -> str:
  """`Type: first line of the message`, bounded (tensorstore errors run long)."""
  text = str(e).strip()
  first = text.splitlines()[0] if text else ""
  return f"{type(e).__name__}: {first[:limit]}"


# ------------------------------------------------------------------ iterator state
class IteratorStateHandler(ocp.CheckpointHandler):
  """Saves a data-iterator state dict as `process_<i>-of-<n>.json`.

  The state is the dict `DatasetIterator.get_state()` returned when `save()`
  was called: a snapshot, so later batches do not leak into the checkpoint
  (Grain's own handler calls `get_state()` itself). One file per process, so
  every host resumes its own shard of the data.
  """

  def save(self, directory: epath.Path, args: "IteratorStateSave") -> None:
    directory = epath.Path(directory)
    filename = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    filename.write_text(json.dumps(args.state, indent=1))

  def restore(self, directory: epath.Path, args: "IteratorStateRestore | None" = None) -> Any:
    del args
    directory = epath.Path(directory)
    filename = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if not filename.exists():
      others = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
      raise CheckpointError(
          f"No data-iterator state {filename.name} in {directory} (found {others}); the"
          " checkpoint was written by a run with another number of processes.")
    return json.loads(filename.read_text())

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


@ocp.args.register_with_handler(IteratorStateHandler, for_save=True)
@dataclasses.dataclass
class IteratorStateSave(ocp.args.CheckpointArgs):
  state: Any


@ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)
@dataclasses.dataclass
class IteratorStateRestore(ocp.args.CheckpointArgs):
  pass


# --------------------------------------------------------------------- manager
@dataclasses.dataclass
class Restored:
  """What `Checkpointer.restore_latest` returns."""

  step: int
  params: dict[str, jax.Array]
  opt_state: Any
  model_state: dict[str, jax.Array]
  data_state: Any
  meta: dict[str, Any]
  skipped: list[int]  # newer steps that were unreadable and moved aside


def abstract_like(tree: Any) -> Any:
  """Concrete sharded arrays -> ShapeDtypeStructs carrying the same shardings."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
  """Periodic async saves, keep-last-k, restore-latest with fallback."""

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3,
               async_save: bool = True, read_only: bool = False):
    """`read_only`: for reading another run's checkpoints (`init_from`, scaling curves),
    which may be training now: nothing is created, and the temporary directory of a save
    in flight is left alone instead of being cleaned up as a killed save's."""
    self.directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep if keep and keep > 0 else None,
        save_interval_steps=1,  # the trainer decides when to save
        enable_async_checkpointing=async_save,
        # Temporary directories left by a process killed mid-save.
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  # ---------------------------------------------------------------- queries
  def steps(self) -> list[int]:
    """Completed checkpoint steps, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def read_meta(self, step: int) -> dict[str, Any]:
    return self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  # ------------------------------------------------------------------- save
  def save(self, step: int, *, params: Mapping[str, jax.Array], opt_state: Any,
           model_state: Mapping[str, jax.Array], data_state: Any,
           meta: Mapping[str, Any]) -> None:
    """Starts an async save of step `step` (waits for the previous one first)."""
    items = dict(
        params=ocp.args.StandardSave(dict(params)),
        opt_state=ocp.args.StandardSave(opt_state),
        data_iter=IteratorStateSave(data_state),
        meta=ocp.args.JsonSave(dict(meta, step=int(step))),
    )
    if model_state:
      items["model_state"] = ocp.args.StandardSave(dict(model_state))
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the save in flight and for the start-up cleanup, then closes.

    `CheckpointManager.close` does not wait for the thread that removes the
    temporary directories of killed saves (only the next `save` does); a
    process that ends before it finishes prints that thread's traceback.
    """
    self._manager.wait_until_finished()
    cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
    if cleanup is not None:
      cleanup.result()
    self._manager.close()

  # ---------------------------------------------------------------- restore
  def _restore_step(self, step: int, *, abstract_params: Any, abstract_opt_state: Any,
                    abstract_model_state: Any) -> Restored:
    items = dict(
        params=ocp.args.StandardRestore(abstract_params),
        data_iter=IteratorStateRestore(),
        meta=ocp.args.JsonRestore(),
    )
    if abstract_opt_state is not None:
      items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    if abstract_model_state:
      items["model_state"] = ocp.args.StandardRestore(abstract_model_state)
    out = self._manager.restore(step, args=ocp.args.Composite(**items))
    meta = out["meta"]
    if not isinstance(meta, dict) or meta.get("step") != step:
      raise CheckpointError(f"metadata of step {step} is missing or inconsistent: {meta!r}")
    return Restored(step=step, params=out["params"], opt_state=out.get("opt_state"),
                    model_state=out.get("model_state") or {}, data_state=out["data_iter"],
                    meta=meta, skipped=[])

  def _move_aside(self, step: int) -> epath.Path:
    src = self.directory / str(step)
    dst = self.directory / f"corrupt-{step}-{int(time.time())}"
    if jax.process_index() == 0 and src.exists():
      src.rename(dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"dloop_move_aside_{step}")
    self._manager.reload()
    return dst

  def restore_latest(self, *, abstract_params: Any, abstract_opt_state: Any,
                     abstract_model_state: Any = None,
                     check_meta: Callable[[dict[str, Any]], None] | None = None
                     ) -> Restored | None:
    """Restores the newest readable checkpoint, or None if there is none.

    Unreadable newer steps are moved aside (so later saves of the same step do
    not collide with them) and reported with a warning.

    Args:
      abstract_params / abstract_opt_state / abstract_model_state: trees of
        `jax.ShapeDtypeStruct` with shardings to restore into.
      check_meta: called with a step's metadata before its arrays are read;
        raises if the checkpoint belongs to another drafter or target (an
        error that must stop the run, not a corruption to skip).

    Raises:
      CheckpointError: checkpoints exist but none of them can be read.
    """
    skipped: list[int] = []
    errors: list[str] = []
    for step in reversed(self.steps()):
      meta = None
      try:
        meta = self.read_meta(step)
      except Exception:  # pylint: disable=broad-except
        pass  # reported below, with the array restore's error
      if meta is not None and check_meta is not None:
        check_meta(meta)
      try:
        restored = self._restore_step(
            step, abstract_params=abstract_params, abstract_opt_state=abstract_opt_state,
            abstract_model_state=abstract_model_state)
      except Exception as e:  # pylint: disable=broad-except
        # Anything from a truncated tensorstore chunk to a garbled JSON file.
        reason = error_summary(e)
        errors.append(f"step {step}: {reason}")
        dst = self._move_aside(step)
        older = [s for s in self.steps() if s < step]
        logging.warning(
            "Checkpoint step %d in %s is corrupted or incomplete (%s); moved it to %s and"
            " %s.", step, self.directory, reason, dst,
            f"falling back to step {older[-1]}" if older else "no older checkpoint is left")
        skipped.append(step)
        continue
      restored.skipped = skipped
      return restored
    if skipped:
      raise CheckpointError(
          f"No readable checkpoint in {self.directory}: " + "; ".join(errors)
          + ". The unreadable steps were moved aside (corrupt-*); delete the directory to"
          " start over, or restore it from a backup.")
    return None

  def restore_params(self, *, abstract_params: Any, abstract_model_state: Any = None,
                     check_meta: Callable[[dict[str, Any]], None] | None = None
                     ) -> tuple[int, dict[str, jax.Array], dict[str, jax.Array], dict]:
    """Newest readable step's weights only (for `init_from`); never moves anything.

    Returns:
      (step, params, model_state, meta).
    """
    errors = []
    for step in reversed(self.steps()):
      try:
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        errors.append(f"step {step}: {error_summary(e)}")
        logging.warning("init_from: checkpoint step %d in %s is unreadable (%s); trying an"
                        " older one.", step, self.directory, errors[-1])
        continue
      if check_meta is not None:
        check_meta(meta)
      items = dict(params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
      if abstract_model_state:
        items["model_state"] = ocp.args.StandardRestore(abstract_model_state)
      try:
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(f"step {step}: {error_summary(e)}")
        logging.warning("init_from: checkpoint step %d in %s is unreadable (%s); trying an"
                        " older one.", step, self.directory, errors[-1])
        continue
      return step, out["params"], out.get("model_state") or {}, out["meta"]
    raise CheckpointError(f"No readable checkpoint in {self.directory}"
                          + (": " + "; ".join(errors) if errors else "") + ".")


def has_checkpoints(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds at least one finished Orbax step (cheap, no manager)."""
  d = epath.Path(directory)
  if not d.exists():
    return False
  return any(p.name.isdigit() and p.is_dir() for p in d.iterdir())
