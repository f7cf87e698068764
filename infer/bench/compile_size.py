"""`python -m infer.bench.compile_size`: what one `generate()` program costs to compile.

    python -m infer.bench.compile_size                          # Qwen3-8B shapes, 4 layers
    python -m infer.bench.compile_size --preset qwen3-4b --set num_layers=2

Lowers and compiles the decode program of several decoding configurations for
a random-weight target of a preset's shapes and its default block drafter,
without materializing a weight (abstract arrays: a Qwen3-8B program compiles on
any machine), and prints, per configuration, the verification widths compiled,
the compile time and the size of the optimized program (instructions of its
HLO). On the CPU backend this measures XLA:CPU's compiler; the program's
structure (how many target forwards it holds) is the backend's too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

CONFIGS = {
    # name: (dtype, weights, generate() options); "costs" names a profile's
    # default table (`decoding.costs.DEFAULT_TABLES`): a CPU's is steep, an
    # accelerator's flat up to tens of tokens.
    "dloop f32, cost schedule, a CPU's cost table": (
        "float32", "f32", dict(mode="dloop", max_stages=3, schedule="cost", costs="cpu")),
    "dloop f32, cost schedule, an accelerator's table, every width compiled": (
        "float32", "f32", dict(mode="dloop", max_stages=3, schedule="cost", costs="gpu",
                               width_tolerance=0.0)),
    "dloop f32, cost schedule, an accelerator's table": (
        "float32", "f32", dict(mode="dloop", max_stages=3, schedule="cost", costs="gpu")),
    "dloop f32, every draft verified": (
        "float32", "f32", dict(mode="dloop", max_stages=3, schedule="off")),
    "dloop bf16, gpu profile (fixed width)": (
        "bfloat16", "bf16", dict(mode="dloop", profile="gpu")),
    "ar bf16, gpu profile (fixed width)": ("bfloat16", "bf16", dict(mode="ar", profile="gpu")),
}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.bench.compile_size", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="qwen3-8b", help="target shapes (infer.profile presets)")
  p.add_argument("--set", default="num_layers=4", help="config overrides, field=value,...")
  p.add_argument("--drafter", default="block", help="drafter kind (default config for the target)")
  p.add_argument("--block-size", type=int, default=4, help="gamma of the drafter")
  p.add_argument("--prompt-length", type=int, default=128)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--json", default=None, help="also write the rows to this JSON file")
  return p.parse_args(argv)


def _abstract(build):
  """The module `build()` makes, as abstract arrays (no memory for its weights)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.eval_shape(build)


def measure(*, preset: str, overrides: str, drafter_kind: str, block_size: int,
            prompt_length: int, max_new_tokens: int) -> list[dict]:
  """One row per configuration of `CONFIGS`: widths, compile seconds, HLO instructions."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import DecodingConfig, engine  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding.costs import DEFAULT_TABLES  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import registry  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import precision  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from infer.profile import presets  # pylint: disable=g-import-not-at-top

  config, _ = presets.preset_config(preset, overrides)
  prompts = [[1] * prompt_length]
  rows = []
  for name, (dtype, weights, options) in CONFIGS.items():
    compute, stored = precision(dtype, weights)
    if isinstance(options.get("costs"), str):
      options = dict(options, costs=DEFAULT_TABLES[options["costs"]])
    # The product forms the profile's targets are loaded with (`models.cpu_kernels`).
    cpu_forms = profiles.resolve(options.get("profile", "cpu")).cpu_kernels

    def build(options=options, compute=compute, stored=stored, cpu_forms=cpu_forms):
      target = Transformer(config, rngs=nnx.Rngs(0), dtype=compute, weight_dtype=stored,
                           cpu_kernels=cpu_forms)
      if options["mode"] == "ar":
        return target, None
      spec = dict(registry.default_drafter_config(drafter_kind, config),
                  block_size=block_size)
      return target, registry.build_drafter(spec, target=target, rngs=nnx.Rngs(0))

    jax.clear_caches()  # each row compiles afresh (rows may share a program shape)
    target, drafter = _abstract(build)
    t0 = time.perf_counter()
    lowered, static = engine.lower(target, prompts, config=DecodingConfig(**options),
                                   max_new_tokens=max_new_tokens, drafter=drafter)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    instructions = sum(1 for line in text.splitlines() if " = " in line)
    rows.append(dict(config=name, widths=list(static.widths), fixed_width=static.fixed_width,
                     block_size=static.block_size, max_stages=static.max_stages,
                     lower_seconds=round(lower_s, 2), compile_seconds=round(compile_s, 2),
                     hlo_instructions=instructions))
    print(f"{name}: widths {list(static.widths)}, lower {lower_s:.1f}s, compile"
          f" {compile_s:.1f}s, {instructions} HLO instructions", file=sys.stderr, flush=True)
  return rows


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  try:
    rows = measure(preset=args.preset, overrides=args.set, drafter_kind=args.drafter,
                   block_size=args.block_size, prompt_length=args.prompt_length,
                   max_new_tokens=args.max_new_tokens)
  except DLoopError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("| configuration | verification widths compiled | compile (s) | HLO instructions |")
  print("|---|---|---|---|")
  for r in rows:
    print(f"| {r['config']} | {', '.join(map(str, r['widths']))} | {r['compile_seconds']:.1f} |"
          f" {r['hlo_instructions']:,} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
