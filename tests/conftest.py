"""Shared test fixtures."""

from __future__ import annotations

import os
import sys

# Tests run on the CPU with f32 and spend most of their time compiling small
# programs: LLVM's optimisation level 0 compiles them faster (matrix products
# still call the same Eigen kernels), and XLA's older loop emitters compile a
# tiny target's dloop program faster than its MLIR fusion emitters. Outputs
# the tests compare are computed by one program shape or compared under the
# near-tie rule, which those flags do not change. The command-line runs of the
# real model the tests start (the shipped drafters' losslessness through the
# benchmark, `python -m infer`, the notebook, the README's example) compile
# with the flags users get ($DLOOP_TEST_REAL_MODEL_XLA_FLAGS, empty: XLA's
# defaults). Every other process the tests start (training, data builds,
# command-line errors on tiny targets) inherits the tiny-program flags.
_TINY_PROGRAM_XLA_FLAGS = ("--xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false")
_REAL_MODEL_XLA_FLAGS = ""
# The suite runs on the CPU whatever the machine has ($DLOOP_TEST_PLATFORMS,
# e.g. "cuda", asks otherwise): on a GPU machine several test processes would
# each claim most of the GPU's memory. Where a test process does use an
# accelerator, it allocates what it needs instead of preallocating.
# Every test process and every command it starts imports jax, flax and more; where the
# environment asks Python not to write bytecode ($PYTHONDONTWRITEBYTECODE, and setup.sh
# installs without compiling), each would compile those packages' sources again on import
# (about 4 s a process). The suite writes the bytecode once and reads it after.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
os.environ["JAX_PLATFORMS"] = os.environ.get("DLOOP_TEST_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Defaults follow the backend's profile (`dloop_jax.profiles`), not the caller's.
os.environ.pop("DLOOP_PROFILE", None)
os.environ.setdefault("XLA_FLAGS", _TINY_PROGRAM_XLA_FLAGS)
os.environ.setdefault("DLOOP_TEST_REAL_MODEL_XLA_FLAGS", _REAL_MODEL_XLA_FLAGS)
sys.path.insert(0, os.path.dirname(__file__))

import atexit  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from dloop_jax.decoding import clear_compiled  # noqa: E402
from dloop_jax.models.transformer import tiny_target  # noqa: E402


# The scheduler's cost table. Tests never calibrate unless they ask to (timing
# would make their schedules depend on the machine's load) and never read or
# write the user's cache: every generate(costs=None) gets this table, the
# per-width costs of a target forward measured for SmolLM2-135M on a 2-core CPU
# (ms; 3 interpolated, 17 and 25 extrapolated; steep, as on CPUs). Tests of
# calibration and caching set their own.
CPU_COSTS = {1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6, 13: 66.8, 17: 72.0, 25: 82.0}
_TEST_CACHE = tempfile.mkdtemp(prefix="dloop_jax_tests_")
os.environ["DLOOP_CACHE_DIR"] = _TEST_CACHE
os.environ["DLOOP_COSTS"] = os.path.join(_TEST_CACHE, "cpu_costs.json")
with open(os.environ["DLOOP_COSTS"], "w") as _f:
  json.dump({"costs": {str(w): c for w, c in CPU_COSTS.items()}}, _f)

# One persistent compilation cache for the whole run, shared by the test
# processes and the command-line runs they start ($DLOOP_JAX_CACHE, read by
# `infer.enable_compilation_cache`): modules free their programs when they end
# (below), and a later module or process that needs the same program loads it
# instead of compiling it again. Made fresh by the first process of a run (the
# others inherit the variable) and removed when that process exits, so the
# user's cache is neither read nor written.
if "DLOOP_JAX_CACHE" not in os.environ:
  os.environ["DLOOP_JAX_CACHE"] = tempfile.mkdtemp(prefix="dloop_jax_xla_")
  atexit.register(shutil.rmtree, os.environ["DLOOP_JAX_CACHE"], ignore_errors=True)
_XLA_CACHE = os.environ["DLOOP_JAX_CACHE"]
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.devices()  # the backend reads XLA_FLAGS now
# A child process that must compute exactly as this one passes these flags.
os.environ["DLOOP_TEST_XLA_FLAGS"] = os.environ["XLA_FLAGS"]


def pytest_collection_modifyitems(config, items):
  """The real model's modules first (their order kept; the rest after, in theirs).

  With `--dist loadfile` each module goes whole to one process; the longest
  ones started first do not leave one process working alone at the end.
  """
  del config
  items.sort(key=lambda item: item.get_closest_marker("real_model") is None)


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
