"""Shared test fixtures."""

from __future__ import annotations

import os
import sys

# Tests run on the CPU with f32; keep XLA from grabbing every core's threads
# per process when several test processes share a small machine.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
sys.path.insert(0, os.path.dirname(__file__))

import gc  # noqa: E402

import pytest  # noqa: E402

from dloop_jax.decoding import clear_compiled  # noqa: E402
from dloop_jax.models.config import tiny_target  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Frees each module's compiled programs when it ends.

  Every XLA:CPU executable holds memory mappings; the whole suite's programs
  in one process would pass the kernel's limit (vm.max_map_count, 65,530),
  where XLA aborts in the middle of a compile.
  """
  yield
  clear_compiled()  # and jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def tiny():
  """A tiny peaked random target (vocab 64, 2 layers)."""
  return tiny_target(seed=1)
