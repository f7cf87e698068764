"""`python -m infer.costs`: the per-width target forward cost table the scheduler uses.

    python -m infer.costs                               # print (measure on first use)
    python -m infer.costs --recalibrate                 # measure again, update the cache
    python -m infer.costs --batch-size 4 --save t.json  # another batch size, also to a file
    python -m infer.costs --widths 1,2,3,5,9,13,17,21   # measure these widths
    python -m infer.costs --drafters NAME,...           # also a drafting stage of each
                                                        # drafter, in one-token forwards
                                                        # (what gate="auto" weighs a stage)
    python -m infer.costs --weights both                # f32 and bf16 tables, and which
                                                        # storage the cpu profile takes here
                                                        # (the cheaper 5-token forward)

The table is cached under $DLOOP_CACHE_DIR/costs/ (default ~/.cache/dloop_jax/costs/),
keyed by target, weight dtypes, jax version, device and batch size; generate(),
python -m infer and the benchmark read it from there (or from --costs / $DLOOP_COSTS).
"""

from __future__ import annotations

import argparse
import sys


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.costs", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct",
                 help="registry name, .gguf path or Hugging Face model directory")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--widths", default="", help="comma-separated widths to measure as well")
  p.add_argument("--weights", choices=("f32", "bf16", "both"), default="f32",
                 help="storage of the target's weight matrices (each has its own table);"
                      " 'both' measures the two and records, for the cpu profile, the one"
                      " whose forward at the cpu profile's fixed width (5 tokens) is cheaper"
                      " on this machine")
  p.add_argument("--cache-length", type=int, default=None,
                 help="measure (and print, not cache) at this many filled cache slots")
  p.add_argument("--recalibrate", action="store_true", help="measure even if cached")
  p.add_argument("--drafters", default="",
                 help="comma-separated drafters (names or export directories): also measure"
                      " (and cache) a drafting stage of each against a one-token forward")
  p.add_argument("--save", default=None, help="also write the table to this JSON file")
  return p.parse_args(argv)


def _draft_stages(args, target, costs_lib) -> None:
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  for name in [d.strip() for d in args.drafters.split(",") if d.strip()]:
    drafter = drafter_io.load_drafter(name, target=target)
    gamma = drafter.block_size
    cached = (None if args.recalibrate else costs_lib.cached_draft_stage(
        target, drafter, batch_size=args.batch_size, block_size=gamma))
    measured = cached if cached is not None else costs_lib.measure_draft_stage(
        target, drafter, batch_size=args.batch_size, block_size=gamma)
    modeled = costs_lib.modeled_draft_stage_fraction(drafter, target, block_size=gamma)
    print(f"drafting stage of {name} (gamma {gamma}): {measured:.3f} of a one-token forward"
          f" {'(cached)' if cached is not None else '(measured)'}; modeled by weight bytes"
          f" {modeled:.3f}")


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import costs as costs_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.registry import load_target  # pylint: disable=g-import-not-at-top
  try:
    try:
      widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
      widths = [0]
    if any(w < 1 for w in widths):
      raise DLoopError(f"--widths must be integers >= 1, got {args.widths!r}.")
    if args.batch_size < 1:
      raise DLoopError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.weights == "both" and (args.cache_length is not None or args.save):
      raise DLoopError("--weights both measures the cached tables; use --weights f32 or bf16"
                       " with --cache-length / --save.")
    step_cost, width_cost = {}, {}
    for weights in (("f32", "bf16") if args.weights == "both" else (args.weights,)):
      # CPU forms on a CPU: the tables the cpu profile's targets will read.
      target = load_target(args.target, weights=weights)
      if args.cache_length is not None:
        table = costs_lib.calibrate(target.model, batch_size=args.batch_size,
                                    widths=sorted(set(widths) | set(costs_lib.DEFAULT_WIDTHS)),
                                    cache_length=args.cache_length)
      else:
        table = costs_lib.for_target(target.model, batch_size=args.batch_size, widths=widths,
                                     recalibrate=args.recalibrate)
      key = table.key or {}
      print(f"{target.name}: batch {args.batch_size}, weights"
            f" {','.join(key.get('weights', []))}, {key.get('device_kind', '?')},"
            f" jax {key.get('jax', '?')}")
      print(table.format())
      step_cost[weights] = table.costs[1]
      width_cost[weights] = float(table.at([profiles.CPU_FIXED_WIDTH])[0])
      if args.save:
        print(f"saved to {table.save(args.save)}", file=sys.stderr)
      _draft_stages(args, target.model, costs_lib)
    if args.weights == "both":
      path = profiles.record_cpu_weights(step_cost, width_cost=width_cost)
      w = profiles.CPU_FIXED_WIDTH
      print(f"one-token step: f32 {step_cost['f32']:.3g}, bf16 {step_cost['bf16']:.3g};"
            f" {w}-token forward: f32 {width_cost['f32']:.3g}, bf16 {width_cost['bf16']:.3g}:"
            f" the cpu profile takes {profiles.resolve('cpu').weights} weights on this machine"
            f" (recorded in {path})")
  except (DLoopError, OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
