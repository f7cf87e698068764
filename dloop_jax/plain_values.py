"""Configs, metrics and array values as plain JSON values (what run records and exports store)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def _is_config_dict(value: Any) -> bool:
  # A ConfigDict exists only once ml_collections is imported: asking the loaded module keeps
  # the library importable where ml_collections is not installed (a stock JAX image).
  mc = sys.modules.get("ml_collections")
  return mc is not None and isinstance(value, (mc.ConfigDict, mc.FrozenConfigDict))


def to_plain(value: Any) -> Any:
  """ConfigDicts and mappings -> dicts (str keys), tuples -> lists, arrays -> (nested) lists."""
  if isinstance(value, Mapping) or _is_config_dict(value):
    return {str(k): to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(value).tolist()
  return value
