"""Configs, metrics and array values as plain JSON values (what run records and exports store)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np


def to_plain(value: Any) -> Any:
  """ConfigDicts and mappings -> dicts (str keys), tuples -> lists, arrays -> (nested) lists."""
  if isinstance(value, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict, Mapping)):
    return {str(k): to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(value).tolist()
  return value
