"""Whether a forward is written for XLA:CPU's kernels or in the standard form.

XLA:CPU runs some products far faster in forms no other backend wants: 16-bit
weight matrices stored transposed ("out-major") and multiplied with the
weights on the left, one-row products padded to two, cache scores computed
slot-major, 16-bit tables gathered as raw bits. Those forms cost extra copies,
transposes and `optimization_barrier`s that keep XLA from fusing, and on GPUs
and TPUs they only get in the way. A forward uses them where `active()`:

    Transformer(cpu_kernels=...)   forms used by its forwards (and by the
                                   decode program built around it)
      None                         this process's backend: on where it is the CPU
      True / False                 forced (the `cpu` / `gpu` / `tpu` profiles)

so the standard forms (the accelerator profiles') run and are tested on a CPU
too. The choice is made while tracing: a model's setting is part of its
graph definition, so programs of models that differ in it are compiled apart.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "dloop_jax_cpu_kernels", default=None)


def on_backend() -> bool:
  """Whether JAX's default backend is the CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.default_backend() == "cpu"


def resolve(setting: bool | None) -> bool:
  """A model's `cpu_kernels` setting (None: this backend's) as a bool."""
  return on_backend() if setting is None else bool(setting)


def active() -> bool:
  """Whether the forward being traced uses the XLA:CPU forms (see `use`)."""
  forced = _FORCED.get()
  return resolve(forced)


@contextlib.contextmanager
def use(setting: bool | None) -> Iterator[None]:
  """Traces the enclosed code with the XLA:CPU forms on, off, or (None) as the backend."""
  token = _FORCED.set(setting)
  try:
    yield
  finally:
    _FORCED.reset(token)
