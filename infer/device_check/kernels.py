"""What a GPU user asks besides correctness: which prefill attention, decode against a long
cache, peak memory, whether the loop copies the cache.

  attention     prefill of one prompt per length through each attention
                implementation of the backend (GPU: cuDNN flash attention
                against XLA's blockwise path; elsewhere XLA's
                `jax.nn.dot_product_attention` stands in for cuDNN): tokens/s,
                compile seconds and the largest |difference| of the prompt's
                last logits from the XLA path's;
  long cache    ms per `ar` step (width 1, batch 1) against a cache holding a
                long prompt (`speed.in_loop`: two runs of one program, prefill
                cancelled), with the cache's capacity: today's decode attends
                over every slot of the capacity;
  memory        the device's peak bytes in use (`device.memory_stats()`), where
                the backend reports it;
  loop copies   copies of cache-shaped arrays inside the loops of the optimized
                decode programs (`dloop_jax.decoding.loop_copies`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from dloop_jax.decoding import generate, loop_copies
from infer.device_check.speed import in_loop
from infer.profile import presets


def implementations(backend: str) -> tuple[str, ...]:
  """Attention implementations compared on a backend, the reference ("xla") first."""
  return ("xla", "cudnn") if backend == "gpu" else ("xla", "dot_product")


def with_attention(target, impl: str):
  """`target` with another prefill attention implementation, sharing its weights."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graph, state = nnx.split(target)
  other = nnx.merge(graph, state)
  other.attention_impl = impl
  return other


def _prefill_logits(target, prompt: np.ndarray):
  """A jitted forward that fills a fresh cache of the prompt's length: the prefill's path
  (`Transformer.__call__`, the chunked XLA path past its chunk, the library call else)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  graph, state = nnx.split(target)
  t = prompt.shape[1]

  @jax.jit
  def forward(state, tokens):
    model = nnx.merge(graph, state)
    cache = model.init_cache(batch_size=1, capacity=t)
    positions = jnp.arange(t)[None, :]
    return model(tokens, positions=positions, cache=cache,
                 logit_positions=jnp.full((1, 1), t - 1)).logits[:, 0].astype(jnp.float32)

  tokens = jnp.asarray(prompt, jnp.int32)
  t0 = time.perf_counter()
  compiled = forward.lower(state, tokens).compile()
  compile_s = time.perf_counter() - t0
  return (lambda: compiled(state, tokens)), compile_s


def attention(*, target, lengths: Sequence[int], repeats: int, backend: str, log=print,
              seed: int = 0) -> list[dict]:
  """Prefill through each attention implementation at each length (module docstring).

  Only prompts longer than `attention.BLOCKWISE_MIN_QUERIES` take the library
  call (shorter ones attend directly, whatever the implementation).

  Returns one entry per (length, implementation): {"length", "impl",
  "tokens_per_s", "seconds", "compile_seconds", "max_abs_diff" (against
  "xla"; 0 for it)}, {"length", "impl", "skipped"} past the device's memory, or {"length", "impl", "error"} where an
  implementation fails (cuDNN refuses some shapes and dtypes).
  """
  import jax  # pylint: disable=g-import-not-at-top
  config = target.config
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    # Not bounded by the context window: the kernels compared do not depend on it (the
    # tiny preset's 256-token target measures a prompt long enough for the library path).
    prompt = rng.integers(0, config.vocab_size, (1, n))
    reference = None
    for impl in implementations(backend):
      entry = dict(length=n, impl=impl)
      try:
        run, compile_s = _prefill_logits(with_attention(target, impl), prompt)
        logits = np.asarray(jax.device_get(run()))
        best = float("inf")
        for _ in range(max(1, repeats)):
          t0 = time.perf_counter()
          jax.block_until_ready(run())
          best = min(best, time.perf_counter() - t0)
        if reference is None:
          reference = logits
        entry.update(tokens_per_s=n / best, seconds=best, compile_seconds=compile_s,
                     max_abs_diff=float(np.abs(logits - reference).max()))
        log(f"prefill {n}, attention {impl}: {n / best:,.0f} tokens/s, max |diff| from xla"
            f" {entry['max_abs_diff']:.3g} (compile {compile_s:.1f} s)")
      except Exception as e:  # pylint: disable=broad-except
        if presets.is_out_of_memory(e):
          entry["skipped"] = "out of device memory"
        else:
          entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        log(f"prefill {n}, attention {impl}: {entry.get('skipped') or entry.get('error')}")
      out.append(entry)
  return out


def long_cache(*, target, contexts: Sequence[int], long_tokens: int, short_tokens: int,
               repeats: int, log=print, seed: int = 1) -> list[dict]:
  """ms per `ar` step (width 1, batch 1) after a prompt of each context length.

  Returns one entry per context: `speed.in_loop`'s fields with "context",
  "capacity" (the cache slots each step attends over) and "compile_seconds",
  or {"context", "skipped"}.
  """
  from dloop_jax.decoding import engine  # pylint: disable=g-import-not-at-top
  config = target.config
  rng = np.random.default_rng(seed)
  out = []
  for n in contexts:
    if n + long_tokens > config.max_position_embeddings:
      out.append(dict(context=n, skipped=f"past the context window of"
                                         f" {config.max_position_embeddings} tokens"))
      log(f"decode after {n} tokens: skipped (context window)")
      continue
    prompt = [rng.integers(0, config.vocab_size, n).tolist()]
    # Width 1: a 16-bit target's `ar` otherwise runs at the profile's fixed width.
    kw = dict(mode="ar", fixed_width=0)
    try:
      first = generate(target, prompt, max_new_tokens=long_tokens, **kw)
      e = in_loop(lambda k: generate(target, prompt, max_new_tokens=k, **kw),
                  long_tokens=long_tokens, short_tokens=short_tokens, repeats=repeats,
                  first=first)
      _, static = engine.decode_program(target, prompt, max_new_tokens=long_tokens, **kw)
    except Exception as err:  # pylint: disable=broad-except
      if not presets.is_out_of_memory(err):
        raise
      out.append(dict(context=n, skipped="out of device memory"))
      log(f"decode after {n} tokens: skipped (out of device memory)")
      continue
    e.update(context=n, capacity=static.capacity, compile_seconds=first.compile_seconds)
    out.append(e)
    ms = e["ms_per_iteration"]
    log(f"decode after {n} tokens: {'–' if ms is None else f'{ms:.3f} ms'} per step"
        f" ({static.capacity}-slot cache; compile {first.compile_seconds:.1f} s)")
  return out


def peak_memory() -> dict:
  """{"peak_bytes", "limit_bytes"} of the first device, or {"n/a": why}."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    stats = jax.devices()[0].memory_stats()
  except (AttributeError, NotImplementedError, RuntimeError):
    stats = None
  if not stats or "peak_bytes_in_use" not in stats:
    return {"n/a": f"the {jax.default_backend()} backend reports no memory statistics"}
  return dict(peak_bytes=int(stats["peak_bytes_in_use"]),
              limit_bytes=int(stats.get("bytes_limit", 0)) or None)


def copies(*, target, prompts, programs: dict[str, dict], max_new_tokens: int) -> dict:
  """In-loop cache copies of each program: {name: {"count", "copies": [op names]}}.

  `programs` are `generate` keyword arguments (`checks.run_plans`) of programs
  already compiled for these prompts and token count: they are read, not
  compiled again.
  """
  out = {}
  for name, kw in programs.items():
    found = loop_copies.decode_cache_copies(target, prompts, max_new_tokens=max_new_tokens, **kw)
    out[name] = dict(count=len(found), copies=[f"{c.shape} {c.op_name}" for c in found])
  return out
