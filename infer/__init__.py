"""Command-line generation: `python -m infer`, and the benchmark `python -m infer.bench`."""

import os


def enable_compilation_cache() -> None:
  """Persistent JAX compilation cache ($DLOOP_JAX_CACHE, else ~/.cache/dloop_jax/jax_compilation).

  A second run of the same command then loads its decode programs instead of
  compiling them: it still traces and lowers them, and the load itself takes
  a good part of the compile time, so a cached start is faster, not instant.
  """
  import jax  # pylint: disable=g-import-not-at-top
  cache_dir = os.environ.get("DLOOP_JAX_CACHE", os.path.join(
      os.path.expanduser("~"), ".cache", "dloop_jax", "jax_compilation"))
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
