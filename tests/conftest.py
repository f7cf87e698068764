"""Shared test fixtures."""

from __future__ import annotations

import os
import sys

# Tests run on the CPU with f32; keep XLA from grabbing every core's threads
# per process when several test processes share a small machine.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from dloop_jax.models.config import tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
  """A tiny peaked random target (vocab 64, 2 layers)."""
  return tiny_target(seed=1)
