"""A package's public names loaded on first use (PEP 562), so that importing one of its
submodules does not import the others.

    __getattr__, __dir__ = lazy_exports.attach(__name__, {"make_dataset": "pkg.pipeline"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def attach(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                              Callable[[], list[str]]]:
  """The module-level `__getattr__` and `__dir__` of `package` for `exports` ({name: module})."""

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    if name not in exports:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(exports[name]), name)
    setattr(sys.modules[package], name, value)
    return value

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(vars(sys.modules[package])) | set(exports))

  return __getattr__, __dir__
