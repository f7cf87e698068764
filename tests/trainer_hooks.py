"""Shared helpers of the trainer tests: tiny configs and which pieces to plug in.

The trainer is tested with the stand-in drafter / loss / data of
`trainer_standin` (small and fast, and annotated with logical axes).
"""

from __future__ import annotations

import importlib.util
import os

from ml_collections import ConfigDict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = "trainer_standin:HOOKS"

# Stand-in parameters on the tiny target (hidden 32, 2 taps).
LARGE_PARAMS = ("fc/kernel", "w_out", "up", "down")  # >= 256 elements
SMALL_PARAMS = ("fc/bias",)
# Logical annotations resolved on a (data 2, fsdp 2, tensor 2) mesh.
ANNOTATED_SPECS = {"up": ["fsdp", "tensor"], "down": ["tensor", "fsdp"]}


def load_config_file(name: str, recipe: str = "") -> ConfigDict:
  path = os.path.join(ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(f"_cfg_{name[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(recipe) if recipe else module.get_config()


# configs/tiny.py:eagle3 made small and quiet, with the stand-in plugged in.
TINY_OVERRIDES = {
    "num_steps": 12, "log_every_steps": 2, "checkpoint.every_steps": 4,
    "data.num_examples": 64, "data.seq_len": 32, "progress_bar": False, "tensorboard": False,
}


def _set(c: ConfigDict, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[leaf] = value


def tiny_config(*, recipe: str = "", hooks: str = STANDIN, **overrides) -> ConfigDict:
  """configs/tiny.py:eagle3 (`recipe`: "" or "loop"), small and quiet, with the stand-in
  plugged in.

  `overrides`: config keys with `__` for dots (`checkpoint__every_steps=2`).
  """
  c = load_config_file("tiny.py", f"eagle3_{recipe}" if recipe else "eagle3")
  c.hooks = hooks
  for key, value in TINY_OVERRIDES.items():
    _set(c, key, value)
  for key, value in overrides.items():
    _set(c, key.replace("__", "."), value)
  return c


# The multi-process test's run: every step logged, and the weights and Adam
# moments split over all 8 devices (fsdp), so each process holds and
# checkpoints only its half of every large array. Online: the target runs in
# the train step, its weights on both processes' devices, each process
# feeding the token ids of its own rows (the offline step's sharding is
# checked in one process, `test_trainer_sharding.results`).
MULTIHOST_SETTINGS = {"log_every_steps": 1, "mesh__data": 1, "mesh__fsdp": 8,
                      "sharding__min_shard_size": 256, "data__online": True}


def tiny_flags(**overrides) -> list[str]:
  """The `--config.*` flags that make `python -m train --config configs/tiny.py:eagle3`
  run `tiny_config(**overrides)`."""
  settings = dict(TINY_OVERRIDES, hooks=STANDIN)
  settings.update({k.replace("__", "."): v for k, v in overrides.items()})
  return [f"--config.{k}={v}" for k, v in settings.items()]
