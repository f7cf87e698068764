"""`python -m infer.bench.int8_parts`: where a decode step's time goes, f32 against int8 weights.

    python -m infer.bench.int8_parts                     # the default model, 1 and 5 tokens
    python -m infer.bench.int8_parts --tokens 1 --repeats 40

Loads the target twice (f32 weights, and int8 in this backend's product form:
`load_target(weights="int8")`) and times, interleaved (`decoding.costs.median_ms`), the
median of --repeats calls of each part at each width T (tokens per forward):

    products   every layer matrix (`LAYER_MATRICES`) times [T, K] activations,
               through the model's own product forms
    head       the LM head on [T, D]
    forward    the whole forward of T tokens after 100 cached tokens

and prints, per part, milliseconds, the weight bytes it streams, the GB/s that
makes, and the f32 / int8 time ratio; "rest" is the forward less the two parts
(attention, norms, RoPE, activation codes, and the cost of running each small
kernel). docs/benchmarks.md ("Int8 weights on the EPYC") keeps the figures.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

_CACHED = 100


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.bench.int8_parts", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct")
  p.add_argument("--tokens", default="1,5", help="comma-separated forward widths T")
  p.add_argument("--repeats", type=int, default=20)
  return p.parse_args(argv)


def _programs(model, tokens: int):
  """{part: (jitted function, its arguments)} for one target at one width."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import LAYER_MATRICES  # pylint: disable=g-import-not-at-top

  graph, state = nnx.split(model)
  c = model.config
  rng = np.random.default_rng(0)
  inputs = {k: jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
            for k in {c.hidden_size, c.q_size, c.intermediate_size}}
  sizes = {"wqkv": c.hidden_size, "wo": c.q_size, "w_gate_up": c.hidden_size,
           "w_down": c.intermediate_size}

  @jax.jit
  def products(state, inputs):
    m = nnx.merge(graph, state)
    total = jnp.zeros((), jnp.float32)
    for layer in m.layers:
      for name in LAYER_MATRICES:
        total += layer._product(inputs[sizes[name]], name)[:, 0].sum()  # pylint: disable=protected-access
    return total

  @jax.jit
  def head(state, h):
    return nnx.merge(graph, state).unembed(h)[..., 0].sum()

  cache = model.init_cache(batch_size=1, capacity=256).with_lengths(
      jnp.full((1,), _CACHED, jnp.int32))

  @jax.jit
  def forward(state, ids, cache):
    m = nnx.merge(graph, state)
    positions = cache.lengths[:, None] + jnp.arange(ids.shape[1])
    return m(ids, positions=positions, cache=cache).logits[..., 0].sum()

  h = jnp.asarray(rng.standard_normal((1, tokens, c.hidden_size)), jnp.float32)
  ids = jnp.ones((1, tokens), jnp.int32)
  return {"products": (products, (state, inputs)), "head": (head, (state, h)),
          "forward": (forward, (state, ids, cache))}


def _weight_bytes(model) -> dict[str, int]:
  """Bytes of the layer matrices (with their scales) and of the LM head each part streams."""
  from dloop_jax.models.transformer import LAYER_MATRICES, SCALE_SUFFIX  # pylint: disable=g-import-not-at-top

  def nbytes(owner, name):
    arrays = [getattr(owner, n, None) for n in (name, name + SCALE_SUFFIX)]
    return sum(int(a[...].nbytes) for a in arrays if a is not None)

  layers = sum(nbytes(layer, name) for layer in model.layers for name in LAYER_MATRICES)
  head = nbytes(model, "lm_head") if getattr(model, "lm_head", None) is not None else nbytes(
      model, "embed")
  return {"products": layers, "head": head}


def main(argv=None) -> int:
  from dloop_jax.decoding import costs  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
  args = _parse(argv)
  try:
    widths = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not widths or min(widths) < 1:
      raise DLoopError(f"--tokens takes positive widths, got {args.tokens!r}.")
    models = {w: load_target(args.target, weights=w).model for w in ("f32", "int8")}
  except (DLoopError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"| {args.target}, T tokens | f32 ms (GB/s of weights) | int8 ms (GB/s) | f32 / int8 |")
  print("|---|---:|---:|---:|")
  for tokens in widths:
    programs = {w: _programs(m, tokens) for w, m in models.items()}
    ms = costs.median_ms({(w, part): functools.partial(fn, *fn_args)
                          for w, calls in programs.items()
                          for part, (fn, fn_args) in calls.items()}, repeats=args.repeats)
    for w in models:
      ms[w, "rest"] = ms[w, "forward"] - ms[w, "products"] - ms[w, "head"]
    sizes = {w: _weight_bytes(m) for w, m in models.items()}
    for part in ("products", "head", "rest", "forward"):
      cells = []
      for w in models:
        streamed = sizes[w].get(part)
        rate = f" ({streamed / ms[w, part] / 1e6:.1f})" if streamed and ms[w, part] > 0 else ""
        cells.append(f"{ms[w, part]:.1f}{rate}")
      print(f"| T={tokens}: {part} | {cells[0]} | {cells[1]} |"
            f" {ms['f32', part] / ms['int8', part]:.2f}× |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
