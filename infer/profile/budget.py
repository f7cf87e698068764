"""The modeled budget of a decode step at 8B shapes, from compiled programs: no device needed.

    python -m infer.profile.budget                       # Qwen3-8B and Llama-3.1-8B, a few minutes
    python -m infer.profile.budget --models qwen3-8b --contexts 1024,32768 --batches 1

For each model, batch and context it compiles, for this process's backend and
with abstract inputs (`jax.ShapeDtypeStruct`: no weights or cache in memory),
the target forward of a decode step (1 token a row) and of a verification
(16 tokens a row: the accelerator profiles' fixed width) against a cache
holding the context, in the accelerator profiles' forms (bf16 weights, compute
and cache; `cpu_kernels=False`), and prints from XLA's analyses of the
optimized programs:

  bytes / step   `compiled.cost_analysis()["bytes accessed"]`: the bytes the
                 program's operations read and write, as XLA's cost model
                 counts them (what bounds a decode step on an accelerator);
  weights, cache the bytes of the weight matrices and of the KV cache's
                 capacity, for scale;
  peak           `compiled.memory_analysis()`: arguments + outputs +
                 temporaries - donated aliases, the memory the program needs.

XLA:CPU multiplies a bf16 matrix by a single row only after converting it to
f32; those conversions (found in the optimized HLO, 8 bytes accessed and 4
bytes held per element) are taken out of both figures and shown apart: no
accelerator makes them. XLA:CPU also writes a bf16 cache through an f32 copy
of each layer's array (converted there and back, every step) and multiplies
the cache in f32: those bytes stay in the figure (how much an accelerator's
compiler saves of them is for the device to say), and the conversions' share
is shown apart, so a change to the attention can be read beside it.

The cache's capacity is the one `generate()` would allocate for the context
plus 256 new tokens (`plan.bucket`: 1k -> 1,536 slots, 8k -> 12,288, 32k
-> 49,152). Compiling every layer of an 8B model is slow on a CPU, so each
program is compiled with 1 and with 2 layers and extrapolated linearly to the
model's depth (every layer is the same program; the embedding, the final norm
and the LM head are the constant part). The numbers are XLA:CPU's optimized
programs when run on a CPU: a GPU's fusions differ, the bytes the operations
touch much less. A loop whose trip count depends on data is counted by its
static shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

# Public configs (config.json) of the two 8B targets the budget models.
MODELS = {
    "qwen3-8b": dict(family="qwen3", qk_norm=True, vocab_size=151936, num_layers=36,
                     hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, tie_embeddings=False),
    "llama-3.1-8b": dict(family="llama", qk_norm=False, vocab_size=128256, num_layers=32,
                         hidden_size=4096, intermediate_size=14336, num_heads=32,
                         num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500_000.0,
                         max_position_embeddings=131072, tie_embeddings=False),
}
NEW_TOKENS = 256
VERIFY_WIDTH = 16


@dataclasses.dataclass(frozen=True)
class Cost:
  """What XLA's analyses say of one compiled program (bytes), and the bytes of the f32 copies
  of bf16 weight matrices XLA:CPU makes for its one-row products (`f32_weight_copies`)."""
  bytes_accessed: float
  flops: float
  peak: float
  f32_weight_copies: float = 0.0
  cache_conversions: float = 0.0

  def __add__(self, other):
    return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  def __sub__(self, other):
    return Cost(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  def __mul__(self, k: float):
    return Cost(*(a * k for a in dataclasses.astuple(self)))


def config_of(name: str, *, num_layers: int | None = None):
  from dloop_jax.models.config import TransformerConfig  # pylint: disable=g-import-not-at-top
  fields = dict(MODELS[name], name=name)
  if num_layers is not None:
    fields["num_layers"] = num_layers
  return TransformerConfig(**fields)


def capacity_for(context: int) -> int:
  """The cache slots `generate()` allocates for `context` prompt tokens and `NEW_TOKENS` more."""
  from dloop_jax.decoding import plan  # pylint: disable=g-import-not-at-top
  return plan.bucket(context + NEW_TOKENS)


def compiled_cost(config, *, batch: int, capacity: int, context: int, width: int) -> Cost:
  """Compiles one forward of `width` tokens a row on abstract bf16 weights and cache."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import cpu_kernels  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  bf16 = jnp.bfloat16
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=bf16,
                                                weight_dtype=bf16, cpu_kernels=False))
  graph, state = nnx.split(abstract)
  cache = jax.eval_shape(lambda: abstract.init_cache(batch_size=batch, capacity=capacity))
  tokens = jax.ShapeDtypeStruct((batch, width), jnp.int32)

  def step(state, cache, tokens):
    model = nnx.merge(graph, state)
    cache = cache.with_lengths(jnp.full((batch,), context, jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(width)[None, :]
    out = model(tokens, positions=positions, cache=cache)
    return out.logits.astype(jnp.float32), out.cache

  with cpu_kernels.use(False):
    compiled = jax.jit(step, donate_argnums=1).lower(state, cache, tokens).compile()
  matrices = {f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state)
              if len(x.shape) >= 2}
  text = compiled.as_text()
  copies = _converted_elements(text, matrices, to="f32")
  layer = {f"{t}[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(cache)
           if len(x.shape) >= 3 for t in ("f32", "bf16")}
  # Each conversion reads one dtype and writes the other: 6 bytes an element.
  cache_conversions = 6.0 * _converted_elements(text, layer, to=None)
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0]
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)
  # A copy reads 2 bytes and writes 4 an element, and its product reads 4 instead of 2.
  return Cost(bytes_accessed=float(cost.get("bytes accessed", 0.0)) - 8.0 * copies,
              flops=float(cost.get("flops", 0.0)), peak=float(peak) - 4.0 * copies,
              f32_weight_copies=4.0 * copies, cache_conversions=cache_conversions)


def _converted_elements(hlo_text: str, shapes: set[str], *, to: str | None) -> int:
  """Elements of the conversions (a `convert`, alone or as a fusion of one) whose result has
  one of `shapes` ("f32[4096,151936]"), of dtype `to` (None: any), in an optimized program.

  XLA:CPU multiplies a bf16 matrix by one row only after converting it to f32,
  and scatters into a bf16 cache through an f32 copy of it; no accelerator
  does either.
  """
  import re  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import loop_copies  # pylint: disable=g-import-not-at-top
  elements = 0
  for line in loop_copies.unfused_instructions(hlo_text):
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*((\w+)\[[\d,]*\])\S*\s+(\w+)\(",
                 line)
    if not m or m.group(2) not in shapes or (to is not None and m.group(3) != to):
      continue
    if m.group(4) == "convert" or (m.group(4) == "fusion" and "convert" in m.group(1)):
      dims = m.group(2).split("[")[1][:-1].split(",")
      n = 1
      for d in dims:
        n *= int(d)
      elements += n
  return elements


def weight_bytes(config) -> int:
  """Bytes of the bf16 weights."""
  return 2 * config.num_params()


def cache_bytes(config, *, batch: int, capacity: int) -> int:
  """Bytes of the bf16 KV cache's capacity (keys and values of every layer)."""
  return 2 * 2 * config.num_layers * batch * capacity * config.num_kv_heads * config.head_dim


def budget(name: str, *, batch: int, context: int, width: int) -> dict:
  """One row: the costs of the 1- and 2-layer programs, extrapolated to the model's depth."""
  full = config_of(name)
  capacity = capacity_for(context)
  one, two = (compiled_cost(config_of(name, num_layers=n), batch=batch, capacity=capacity,
                            context=context, width=width) for n in (1, 2))
  layer = two - one
  cost = one + layer * (full.num_layers - 1)
  return dict(model=name, batch=batch, context=context, capacity=capacity, width=width,
              bytes_accessed=cost.bytes_accessed, flops=cost.flops, peak=cost.peak,
              f32_weight_copies=cost.f32_weight_copies, cache_conversions=cost.cache_conversions,
              weights=weight_bytes(full),
              cache=cache_bytes(full, batch=batch, capacity=capacity))


def markdown(rows) -> str:
  gb = lambda x: f"{x / 1e9:,.1f}"  # pylint: disable=unnecessary-lambda-assignment
  lines = ["| model | batch | context | cache slots | forward | bytes accessed / step (GB) |"
           " weights (GB) | KV cache (GB) | bytes / (weights + cache) | peak memory (GB) |"
           " TFLOP / step | XLA:CPU's f32 weight copies, left out (GB) |"
           " of the bytes: XLA:CPU's cache conversions (GB) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    forward = "decode (1 token)" if r["width"] == 1 else f"verify ({r['width']} tokens)"
    lines.append(f"| {r['model']} | {r['batch']} | {r['context']:,} | {r['capacity']:,} |"
                 f" {forward} | {gb(r['bytes_accessed'])} | {gb(r['weights'])} |"
                 f" {gb(r['cache'])} | {r['bytes_accessed'] / (r['weights'] + r['cache']):.2f} |"
                 f" {gb(r['peak'])} | {r['flops'] / 1e12:.2f} | {gb(r['f32_weight_copies'])} |"
                 f" {gb(r['cache_conversions'])} |")
  return "\n".join(lines)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m infer.profile.budget", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
  p.add_argument("--contexts", default="1024,8192,32768")
  p.add_argument("--batches", default="1,32")
  p.add_argument("--widths", default=f"1,{VERIFY_WIDTH}",
                 help="tokens a row per forward (1: decode step; 16: verification)")
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = [m for m in models if m not in MODELS]
  if unknown:
    print(f"error: unknown model(s) {unknown}; known: {', '.join(MODELS)}", file=sys.stderr)
    return 2
  rows, start = [], time.perf_counter()
  for name in models:
    for batch in _ints(args.batches):
      for context in _ints(args.contexts):
        for width in _ints(args.widths):
          rows.append(budget(name, batch=batch, context=context, width=width))
          print(f"[budget {time.perf_counter() - start:6.1f} s] {name} batch {batch} context"
                f" {context} width {width}: {rows[-1]['bytes_accessed'] / 1e9:,.1f} GB",
                file=sys.stderr, flush=True)
  print(f"Compiled for {jax.default_backend()} (jax {jax.__version__}); 1- and 2-layer programs"
        " extrapolated to each model's depth; bf16 weights, compute and cache.\n")
  print(markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
