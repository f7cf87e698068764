"""Trains a drafter.

    python -m train --config configs/<name>.py[:recipe] --workdir DIR [--config.key=value ...]
        [--coordinator_address HOST:PORT --num_processes N --process_id I]

Rerunning the same command resumes from the newest complete checkpoint in
DIR/checkpoints. At the end the drafter alone is exported to DIR/export,
which `dloop_jax.drafters.io.load_drafter` and `python -m infer --drafter`
read. A multi-process (pod) run starts the same command in every process;
see docs/training.md.
"""

from __future__ import annotations

import importlib.util
import logging as py_logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config file (configs/*.py), optionally `path:recipe`.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: checkpoints, metrics.jsonl, export/.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-process runs: host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS;"
    " detected under SLURM, Open MPI and on Cloud TPU).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None,
    "Multi-process runs: processes in the job (default: $JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-process runs: this process, 0 .. num_processes - 1 (default:"
    " $JAX_PROCESS_ID).")
flags.mark_flags_as_required(["config", "workdir"])

_QUIET_MODULES = ("orbax", "etils", "tensorstore")


class _QuietLibraries(py_logging.Filter):
  """Drops INFO chatter of the checkpoint libraries (one block per save)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    path = record.pathname.replace(os.sep, "/")
    return not any(f"/{m}/" in path for m in _QUIET_MODULES)


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _config_arg(argv: Sequence[str]) -> tuple[str | None, list[str]]:
  """(--config value, dotted keys of --config.* overrides) from the raw argv."""
  path, keys = None, []
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
    elif arg.startswith("--config."):
      keys.append(arg[len("--config."):].split("=", 1)[0])
  return path, keys


def _load_config_file(spec: str) -> Any:
  path, arg = spec, None
  if not os.path.exists(path) and ":" in spec:
    path, arg = spec.rsplit(":", 1)
  if not os.path.isfile(path):
    _fail(f"config file {path!r} does not exist.")
  module_spec = importlib.util.spec_from_file_location("_train_config", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    # A locked ConfigDict rejects a misspelt key with a "did you mean" hint.
    message = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
    _fail(f"in config {spec}: {message}")


def _has_key(config: Any, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    try:
      node = node[part]
    except (KeyError, TypeError, AttributeError):
      return False
  return True


def precheck(argv: Sequence[str]) -> None:
  """Turns config-file and --config.key typos into one-line errors.

  config_flags reports both as tracebacks from deep inside flag parsing.
  """
  from dloop_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

  spec, keys = _config_arg(argv)
  if spec is None:
    return  # absl reports the missing required flag
  config = _load_config_file(spec)
  candidates = [k for k, _ in _walk_all(config)]
  for key in keys:
    if not _has_key(config, key):
      _fail(f"unknown config key {key!r} (from --config.{key})"
            f"{config_lib.suggest(key, candidates)}")


def _walk_all(config: Any, prefix: str = ""):
  for key, value in config.items():
    yield f"{prefix}{key}", value
    if hasattr(value, "items"):
      yield from _walk_all(value, f"{prefix}{key}.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  for handler in py_logging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_QuietLibraries())
  # Local imports: jax must not be initialized before jax.distributed.
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import distributed  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import trainer  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  try:
    distributed.initialize(
        config.distributed, coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
    result = trainer.train(config, _WORKDIR.value)
  except DLoopError as e:
    _fail(str(e))
  summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())
                      if isinstance(v, float))
  where = f"; drafter exported to {result.export_dir}" if result.export_dir else ""
  early = " (stopped early: eval.patience)" if result.stopped_early else ""
  print(f"done: step {result.step}{early}{where}. {summary}", file=sys.stderr)


def run() -> None:
  precheck(sys.argv[1:])
  app.run(main)


if __name__ == "__main__":
  run()
