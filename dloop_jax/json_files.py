"""JSON files replaced atomically: a reader sees the old file or the new one, never a part."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str | os.PathLike, data: Any, *, sort_keys: bool = False,
               default: Any = None) -> str:
  """Writes `data` as JSON (indent 1) to `path` under a temporary name, then renames it;
  creates the directory. Returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=sort_keys, default=default)
  os.replace(tmp, path)
  return path
