"""Reading a public drafter checkpoint directory into one of our drafters."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
from flax import nnx

from dloop_jax.drafters import registry
from dloop_jax.drafters import variables as variables_lib
from dloop_jax.drafters.base import Frozen
from dloop_jax.drafters.hf_format import common
from dloop_jax.drafters.hf_format import detect
from dloop_jax.drafters.hf_format import dflash
from dloop_jax.drafters.hf_format import domino
from dloop_jax.drafters.hf_format import dspark
from dloop_jax.drafters.hf_format import eagle3
from dloop_jax.models import hf_loader

_READERS = {"eagle3": eagle3.read, "dflash": dflash.read, "dspark": dspark.read,
            "domino": domino.read}


def load_hf_drafter(path: str | os.PathLike, *, target: Any,
                    rngs: nnx.Rngs | None = None) -> nnx.Module:
  """Reads an EAGLE-3, DFlash, DSpark or Domino checkpoint directory into our drafter.

  Args:
    path: directory with config.json and model.safetensors (sharded or not)
      or pytorch_model.bin.
    target: the target `Transformer`; float weights are cast to its dtype.
    rngs: RNG streams of the construction (every weight is overwritten).

  Returns:
    An `Eagle3Drafter`, `BlockDrafter`, `DSparkDrafter` or `DominoDrafter`.

  Raises:
    ModelLoadError: missing / unreadable files, missing or misshapen tensors.
    CheckpointFormatError: an unknown layout, or one our drafters cannot represent.
    DrafterMismatchError: the checkpoint belongs to another target.
  """
  path = os.path.abspath(os.fspath(path))
  hf = hf_loader.read_hf_config(path)
  kind = detect.detect_kind(hf, source=os.path.join(path, common.CONFIG_FILE))
  tensors = common.read_tensors(path)
  config, params, model_state, embed = _READERS[kind](hf, tensors, target, source=path)
  drafter = registry.build_for_loading(config, target=target, rngs=rngs)
  _, param_state, _, _, state = variables_lib.split_drafter(drafter)
  dtype = getattr(target, "dtype", jnp.float32)
  nnx.update(drafter, variables_lib.assign(param_state, params, dtype=dtype, what="Weights",
                                           source=path))
  if model_state:
    nnx.update(drafter, variables_lib.assign(state, model_state, dtype=dtype,
                                             what="Variables", source=path))
  if embed is not None:
    # The checkpoint ships its own (frozen) embedding: use it, not the target's.
    drafter.embed = Frozen(jnp.asarray(embed, dtype))
  drafter.check_target(target.config)
  return drafter


