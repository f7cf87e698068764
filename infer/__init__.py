"""Command-line generation: `python -m infer`, and the benchmark `python -m infer.bench`."""


def enable_compilation_cache() -> None:
  """JAX's persistent compilation cache for a command-line run (`dloop_jax.compilation_cache`).

  A second run of the same command then loads its decode programs instead of
  compiling them ($DLOOP_JAX_CACHE=off opts out).
  """
  from dloop_jax import compilation_cache  # pylint: disable=g-import-not-at-top
  compilation_cache.enable(force=True)
