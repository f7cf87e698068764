"""What a training run reports as it goes: metrics.jsonl, TensorBoard, a progress bar.

Only process 0 writes. A resumed run first drops the lines past its restored
step (written by the killed run after its last checkpoint), so the file holds
each step once.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
  """JSONL (always) and TensorBoard (if a writer package is installed)."""

  def __init__(self, workdir: str, *, start_step: int, tensorboard: bool):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, METRICS_FILE)
    self._tb = None
    if not self.enabled:
      return
    if os.path.exists(self.path):
      # Lines past the restored step were written by a run killed before its
      # next checkpoint; the resumed run writes them again.
      with open(self.path) as f:
        kept = [line for line in f if line.strip() and _line_step(line) <= start_step]
      with open(self.path, "w") as f:
        f.writelines(kept)
    if tensorboard:
      self._tb = _tensorboard_writer(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _line_step(line: str) -> int:
  try:
    return int(json.loads(line).get("step", 0))
  except ValueError:
    return sys.maxsize  # a torn last line: drop it


def _tensorboard_writer(logdir: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("tensorboardX") is not None:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter(logdir)
  if (importlib.util.find_spec("tensorboard") is not None
      and importlib.util.find_spec("torch") is not None):
    from torch.utils.tensorboard import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter(logdir)
  logging.info("No TensorBoard writer installed (tensorboardX); metrics go to %s only.",
               METRICS_FILE)
  return None


def progress_bar(total: int, initial: int, enabled: bool):
  """A tqdm bar on process 0 (None when disabled, on other processes, or without tqdm)."""
  if not enabled or jax.process_index() != 0:
    return None
  try:
    from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm.tqdm(total=total, initial=initial, desc="train", unit="step",
                   dynamic_ncols=True, mininterval=0.5, file=sys.stderr)


def host_scalar(x: Any) -> Any:
  """A fetched metric as a Python number (a list when it is not a scalar)."""
  a = np.asarray(x)
  if a.size == 1:
    v = a.reshape(()).item()
    return float(v) if isinstance(v, (float, np.floating)) or a.dtype.kind == "f" else v
  return a.tolist()
