"""Library attention kernels, chosen per backend by a target's `attention_impl`.

    attention_impl   prefill (T = C)                 short forwards (decode, verification)
    "xla"            blockwise / bounded XLA forms   `attention.bounded_attention` (standard
                                                     form) or the dense scores (XLA:CPU)
    "cudnn"          `jax.nn.dot_product_attention`  committed slots: Pallas GPU
                     (implementation="cudnn")        `decode_attention.mqa` (flash decoding,
                                                     a length per row), merged with the new
                                                     tokens' own block (16-bit caches)
    "dot_product"    `jax.nn.dot_product_attention`  as "xla"
                     (implementation="xla")
    "pallas_tpu"     as "xla"                        one-token steps: Pallas TPU
                                                     `paged_attention` (the cache's
                                                     slots as pages, a length per row;
                                                     16-bit caches); the rest as "xla"

"cudnn" is the `gpu` profile's, "pallas_tpu" the `tpu` profile's. Their
kernels compile for their device only: on another backend such a target runs
the "xla" forms (the reference they are tested against, at the CPU's speed
and memory), unless `interpret(True)` (or `$DLOOP_INTERPRET_KERNELS=1`) asks
for the kernels' code paths: then prefill takes
`jax.nn.dot_product_attention`'s XLA implementation (cuDNN has no
interpreter) and the Pallas kernels run in Pallas's interpret mode (slowly:
tests and tiny targets).

The TPU paged kernel returns normalized outputs without their softmax
statistics, so it cannot be merged with a separate block of new tokens: it
serves the one-token steps, where the new token is in the cache; the splash
and ragged paged kernels are not used (splash masks its blocks from a static
mask, not from per-row lengths; this JAX's ragged paged kernel reads keys
and values interleaved in one array, which the cache does not hold).

Where the library kernels do not reach, the XLA forms stay:
- A written short forward of more than one token (every forward of a
  fixed-width profile). Decoding modes reproduce `ar` bit for bit at a fixed
  width because a token reads the same slots in the same blocks in the same
  order whether it is verified among drafts or decoded alone
  (`attention.bounded_attention`). The decode kernel takes one length per
  row, so the drafts' chain / tree mask has to come from a separate block
  merged afterwards, and a token's committed part then differs between the
  two (its predecessors are committed slots in one, new tokens in the
  other): the outputs would differ in the last bits. Keeping the kernel
  there would need a kernel of our own with a per-token mask over the
  written cache.
- f32 caches: the library kernels multiply 16-bit operands (Triton's f32
  products are not full precision), and an f32 target's forwards run at full
  precision on accelerators.
- Capacities the kernel's blocking cannot split (see `_gpu_blocks`).

Which of them a program holds is read while tracing it (`recording`): the
engine reports it per program (`GenerationOutput.attention_kernels`, `python
-m infer --json`), so that a run can tell whether the kernels it asked for
are the ones it got.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_INTERPRET: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "dloop_jax_interpret_kernels", default=None)
# The kernels traced under the innermost `recording()` (None: no recording open).
_TRACED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "dloop_jax_traced_kernels", default=None)

# Slots per kernel block and at most this many splits of the cache per
# (row, kv head) (flash decoding: the splits run in parallel, then merge).
GPU_BLOCK_K = 128
GPU_MAX_SPLITS = 16
# The kernel's smallest block (a Triton product needs 16 rows).
_GPU_MIN_BLOCK = 16


@contextlib.contextmanager
def interpret(setting: bool = True) -> Iterator[None]:
  """Runs the library kernels in Pallas's interpret mode off their device (traced inside)."""
  token = _INTERPRET.set(setting)
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def interpreting() -> bool:
  """Whether kernels traced now run in interpret mode (`interpret`, else the environment)."""
  forced = _INTERPRET.get()
  if forced is not None:
    return forced
  return os.environ.get("DLOOP_INTERPRET_KERNELS", "").strip() not in ("", "0")


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
  """Collects the names of the library kernels that the programs traced inside call.

  "cudnn" / "dot_product": prefill through `jax.nn.dot_product_attention`
  (cuDNN's implementation / XLA's); "pallas_gpu": Pallas GPU flash decoding;
  "pallas_tpu": Pallas TPU paged attention; a Pallas name ends in
  "_interpret" where the kernel runs in interpret mode. What the program
  holds, not what a run of it executes: a kernel in a branch or a loop the
  run never enters counts. The XLA forms are not named.
  """
  kernels: set[str] = set()
  token = _TRACED.set(kernels)
  try:
    yield kernels
  finally:
    _TRACED.reset(token)


def note(name: str) -> None:
  """Records that the program being traced calls kernel `name` (`recording`)."""
  kernels = _TRACED.get()
  if kernels is not None:
    kernels.add(name)


def _on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _half(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 2


def prefill_impl(impl: str, cache_dtype) -> str:
  """How a forward that fills a fresh cache attends: "xla", "cudnn" or "dot_product"."""
  if impl == "pallas_tpu" or (impl == "cudnn" and not _half(cache_dtype)):
    return "xla"
  if impl == "cudnn" and not _on_gpu():
    return "dot_product" if interpreting() else "xla"
  return impl


def decode_kernel(impl: str, cache_dtype) -> str | None:
  """The library kernel of short forwards: "gpu" / "tpu" (compiled), "gpu_interpret" /
  "tpu_interpret", or None (the XLA forms)."""
  device = {"cudnn": "gpu", "pallas_tpu": "tpu"}.get(impl)
  if device is None or not _half(cache_dtype):
    return None
  on_device = _on_gpu() if device == "gpu" else jax.default_backend() == "tpu"
  if on_device:
    return device
  return f"{device}_interpret" if interpreting() else None


def _gpu_blocks(capacity: int) -> tuple[int, int] | None:
  """(block_k, k_splits) of the GPU decode kernel over `capacity` slots, or None.

  The kernel splits the cache into `k_splits` equal parts of whole blocks of
  at least 16 slots.
  """
  splits = GPU_MAX_SPLITS
  while splits >= 1:
    if capacity % splits == 0:
      block = math.gcd(capacity // splits, GPU_BLOCK_K)
      if block >= _GPU_MIN_BLOCK:
        return block, splits
    splits //= 2
  return None


def gpu_supports(*, capacity: int, head_dim: int) -> bool:
  """Whether the GPU decode kernel takes a cache of this shape."""
  return _gpu_blocks(capacity) is not None and head_dim % 16 == 0


def gpu_committed(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
                  scale: float, interpret: bool):
  """Online-softmax state of queries over each (row, kv head)'s first `lengths` slots.

  Pallas GPU flash decoding (`jax.experimental.pallas.ops.gpu.decode_attention`):
  each (row, kv head) reads only the blocks below its length.

  Args:
    qg: [B * K, Q, H] queries grouped per (row, kv head) (Q = G * T).
    k_cache, v_cache: [B * K, C, H] one layer's cache (16-bit).
    lengths: [B * K] slots each pair sees.
    scale: the softmax scale.
    interpret: run in Pallas's interpret mode.

  Returns:
    (running max [B * K, Q], normalizer [B * K, Q], weighted sum of the
    values [B * K, Q, H]), all f32, in the form `attention._online_step`
    carries (a pair with no slot: max at the f32 floor, zeros).
  """
  from jax.experimental.pallas.ops.gpu import decode_attention  # pylint: disable=g-import-not-at-top
  note("pallas_gpu_interpret" if interpret else "pallas_gpu")
  block_k, k_splits = _gpu_blocks(k_cache.shape[1])
  out, (l, m) = decode_attention.mqa(
      qg.astype(k_cache.dtype), k_cache, v_cache, kv_seq_len=lengths, sm_scale=scale,
      block_k=block_k, k_splits=k_splits, interpret=interpret, return_residuals=True)
  # `out` is normalized: the unnormalized sum is out * l.
  return m, l, out.astype(jnp.float32) * l[..., None]


# Slots per page of the TPU paged kernel's view of the cache, and at most this
# many pages per kernel block.
TPU_PAGE = 64
TPU_PAGES_PER_BLOCK = 8


def _tpu_pages(capacity: int) -> tuple[int, int] | None:
  """(page size, pages per compute block) over `capacity` slots, or None."""
  page = math.gcd(capacity, TPU_PAGE)
  if page < _GPU_MIN_BLOCK:
    return None
  return page, math.gcd(capacity // page, TPU_PAGES_PER_BLOCK)


def tpu_supports(*, capacity: int) -> bool:
  """Whether the TPU paged kernel takes a cache of `capacity` slots."""
  return _tpu_pages(capacity) is not None


def tpu_step(qg: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
             scale: float, interpret: bool) -> jax.Array:
  """Normalized attention of one-token queries over each (row, kv head)'s first `lengths` slots.

  Pallas TPU paged attention: each (row, kv head) is a sequence of one kv
  head whose pages are its own slots in order (a reshape of the cache, no
  copy), and the kernel reads only the pages below its length.

  Args:
    qg: [B * K, G, H] queries grouped per (row, kv head).
    k_cache, v_cache: [B * K, C, H] one layer's cache (16-bit).
    lengths: [B * K] slots each pair sees (>= 1).
    scale: the softmax scale.
    interpret: run in Pallas's TPU interpret mode.

  Returns:
    [B * K, G, H] f32.
  """
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # pylint: disable=g-import-not-at-top
  note("pallas_tpu_interpret" if interpret else "pallas_tpu")
  pairs, capacity, head = k_cache.shape
  page, per_block = _tpu_pages(capacity)
  pages = capacity // page
  view = lambda x: x.reshape(1, pairs * pages, page, head)
  indices = jnp.arange(pairs * pages, dtype=jnp.int32).reshape(pairs, pages)
  # The kernel does not scale: the queries carry it.
  q = (qg.astype(jnp.float32) * scale).astype(k_cache.dtype)
  call = lambda: paged_attention(q, view(k_cache), view(v_cache), lengths.astype(jnp.int32),
                                 indices, pages_per_compute_block=per_block)
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      return call().astype(jnp.float32)
  return call().astype(jnp.float32)
