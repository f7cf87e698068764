"""Writing our drafters in the public layout of their kind (for SGLang / vLLM)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dloop_jax.drafters.hf_format import common
from dloop_jax.drafters.hf_format import dflash
from dloop_jax.drafters.hf_format import domino
from dloop_jax.drafters.hf_format import dspark
from dloop_jax.drafters.hf_format import eagle3
from dloop_jax.errors import CheckpointFormatError


def _layout(drafter: nnx.Module):
  # Subclasses first: DSpark and Domino drafters are block drafters too.
  from dloop_jax.drafters.block import BlockDrafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.domino import DominoDrafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.dspark import DSparkDrafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.eagle3 import Eagle3Drafter  # pylint: disable=g-import-not-at-top

  for cls, module in ((DSparkDrafter, dspark), (DominoDrafter, domino), (Eagle3Drafter, eagle3),
                      (BlockDrafter, dflash)):
    if isinstance(drafter, cls):
      return module.layout
  raise CheckpointFormatError(f"{type(drafter).__name__} has no Hugging Face layout; only"
                              " EAGLE-3, block (DFlash), DSpark and Domino drafters can be"
                              " written in one.")


def export_hf(drafter: nnx.Module, path: str | os.PathLike, *, target_name: str = "",
              dtype: Any | None = None) -> str:
  """Writes `drafter` as config.json + model.safetensors in the public layout of its kind.

  EAGLE-3 drafters are written in SpecForge's layout (`midlayer.`, d2t offsets,
  t2d mask), block drafters in z-lab's DFlash layout, DSpark drafters in
  DeepSpec's (with its frozen copies of the target's embedding and LM head),
  Domino drafters in Domino's. The others leave out the target's embedding and
  LM head (readers take the target's), as upstream. In a multi-process run
  every process calls it (split weights are gathered) and process 0 writes.

  Args:
    drafter: an `Eagle3Drafter`, `BlockDrafter`, `DSparkDrafter` or `DominoDrafter`.
    path: output directory (created; its config.json and model.safetensors
      are replaced).
    target_name: recorded in config.json (informational).
    dtype: storage dtype of float weights (default: as they are).

  Returns:
    The directory.

  Raises:
    CheckpointFormatError: the drafter uses something the layout cannot hold.
  """
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  config, tensors = _layout(drafter)(drafter, dtype)
  floats = {str(x.dtype) for x in tensors.values() if np.issubdtype(x.dtype, np.floating)
            or x.dtype.name == "bfloat16"}
  config["torch_dtype"] = floats.pop() if len(floats) == 1 else "float32"
  config[common.META_KEY] = {"block_size": int(drafter.block_size), "target": target_name,
                             "target_fingerprint": dict(drafter.target_fingerprint)}
  path = os.path.abspath(os.fspath(path))
  if jax.process_index() == 0:
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, common.CONFIG_FILE)
    if os.path.exists(config_path):
      os.remove(config_path)  # incomplete until the new config lands
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                                os.path.join(path, common.SAFETENSORS_FILE),
                                metadata={"format": "pt"})
    with open(config_path + ".tmp", "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    os.replace(config_path + ".tmp", config_path)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("dloop_export_hf")
  return path
