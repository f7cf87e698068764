"""Times a decode step of the f32 default target with dense and with length-bounded attention.

    python scripts/decode_attention_timing.py --length 2000 --capacities 2112,3072,8192 \
        --widths 1,16

The cache holds a prefill of `--length` random tokens; each step writes its
`width` tokens past it and is rolled back (the cache donated, updated in
place as in the decode loop). The two forms (`attention.cached_attention`'s
dense scores and `attention.bounded_attention`) run interleaved, so that a
loaded machine slows both alike; the ratio is what to read. Prints the median
step of each and the largest logit difference between them.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.models import attention
from dloop_jax.models.registry import load_target


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--length", type=int, default=2000)
  parser.add_argument("--capacities", default="2112,3072,8192")
  parser.add_argument("--widths", default="1,16")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()

  target = load_target(args.target, weights="f32").model
  graph, state = nnx.split(target)

  def program(dense: bool):
    def step(state, tokens, cache):
      chosen = attention.dense_short_forwards
      attention.dense_short_forwards = lambda **_: dense  # read while tracing
      try:
        out = nnx.merge(graph, state)(
            tokens, positions=cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None],
            cache=cache)
      finally:
        attention.dense_short_forwards = chosen
      return out.logits, out.cache.with_lengths(cache.lengths)
    return jax.jit(step, donate_argnums=(2,))

  @jax.jit
  def prefill(state, tokens, cache):
    model = nnx.merge(graph, state)
    return model(tokens, positions=jnp.arange(tokens.shape[1])[None], cache=cache).cache

  programs = {form: program(form == "dense") for form in ("dense", "bounded")}
  rng = np.random.default_rng(0)
  vocab = target.config.vocab_size
  prompt = jnp.asarray(rng.integers(0, vocab, (1, args.length)), jnp.int32)
  for capacity in map(int, args.capacities.split(",")):
    filled = prefill(state, prompt, target.init_cache(batch_size=1, capacity=capacity))
    caches = {form: jax.tree.map(jnp.copy, filled) for form in programs}
    for width in map(int, args.widths.split(",")):
      tokens = jnp.asarray(rng.integers(0, vocab, (1, width)), jnp.int32)
      logits, times = {}, {form: [] for form in programs}
      for form, run in programs.items():  # compile
        logits[form], caches[form] = run(state, tokens, caches[form])
      for _ in range(args.repeats):
        for form, run in programs.items():
          start = time.perf_counter()
          out, caches[form] = run(state, tokens, caches[form])
          out.block_until_ready()
          times[form].append(time.perf_counter() - start)
      dense, bounded = (np.median(times[f]) * 1e3 for f in ("dense", "bounded"))
      diff = float(jnp.max(jnp.abs(logits["dense"] - logits["bounded"])))
      print(f"length {args.length}, capacity {capacity} (blocks of"
            f" {attention.decode_key_block(capacity)}), width {width}: dense {dense:.1f} ms,"
            f" bounded {bounded:.1f} ms, bounded / dense {bounded / dense:.2f},"
            f" max |logit difference| {diff:.1e}", flush=True)


if __name__ == "__main__":
  main()
