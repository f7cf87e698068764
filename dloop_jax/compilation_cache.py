"""JAX's persistent compilation cache, on by default for every user of the library.

A decode program of a real target takes tens of seconds to compile on a CPU
and the same program comes back in every new process (a notebook's kernel
restart, the next command). `generate()` turns the cache on at its first
compilation, so the next process loads the program instead of compiling it:

    $DLOOP_JAX_CACHE          where (default jax_compilation/ in this machine's
                              cache directory: $DLOOP_CACHE_DIR, else ~/.cache/dloop_jax)
    $DLOOP_JAX_CACHE=off      opt out (also "0", "false", "none")
    jax_compilation_cache_dir already set (by the caller): that one is kept

Loading still traces and lowers the program, and the load itself takes time,
so a second run is faster but not free (docs/benchmarks.md).
"""

from __future__ import annotations

import os

OPT_OUT = ("off", "0", "false", "none")
# Programs that compile faster than this are not worth a file.
MIN_COMPILE_SECONDS = 0.5

_checked = False


def default_directory() -> str:
  """jax_compilation/ beside the machine's other measurements (`profiles.cache_dir()`)."""
  from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
  return os.path.join(profiles.cache_dir(), "jax_compilation")


def enable(*, force: bool = False) -> str | None:
  """Turns the persistent cache on; returns its directory (None: opted out or left as set).

  Args:
    force: use `$DLOOP_JAX_CACHE` (or the default directory) even where the
      process already set a cache directory (the command-line programs).
  """
  import jax  # pylint: disable=g-import-not-at-top
  chosen = os.environ.get("DLOOP_JAX_CACHE", "").strip()
  if chosen.lower() in OPT_OUT:
    return None
  if jax.config.jax_compilation_cache_dir and not force:
    return None
  directory = chosen or default_directory()
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return directory


def ensure() -> None:
  """`enable()` once per process (what `generate()` calls before it compiles)."""
  global _checked
  if not _checked:
    _checked = True
    enable()
