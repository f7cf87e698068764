"""Paths as result files record them: exports, benchmark results and run metadata travel to
other machines (and into the repository), where this machine's directories mean nothing."""

from __future__ import annotations

import os


def recorded_path(path: str | os.PathLike) -> str:
  """`path` relative to the working directory when inside it, else its last two components."""
  path = os.fspath(path)
  rel = os.path.relpath(os.path.abspath(path))
  if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
    return rel
  return "/".join(os.path.normpath(os.path.abspath(path)).split(os.sep)[-2:])


def recorded_name(name: str) -> str:
  """A drafter or target given by registry name or by path: the name as is, a path recorded."""
  return recorded_path(name) if os.sep in name or os.path.exists(name) else name
