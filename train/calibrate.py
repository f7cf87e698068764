"""Calibration tables of drafters: what a stage of drafts yields, by its score.

    python -m train.calibrate --drafters smollm2-135m-instruct-block,runs/block/best
    python -m train.calibrate --drafters smollm2-135m-instruct-dspark --write

For each drafter (a shipped name, an export directory or a training workdir)
it measures, teacher-forced on the target's own greedy answers to held-out
prompts, P(a stage is fully accepted), E(its accepted drafts) and E(the next
stage's accepted drafts) per bin of the stage's score u = sum_k log c_k
(`dloop_jax.decoding.calibration`; measured by
`dloop_jax.training.calibration`), for the round's first stage and for the
looped stages after it: the table `gate="auto"` reads. Drafters with a learned
confidence head (DSpark) get a second table scored by it.

The prompts are the benchmark's categories (math, code, chat; the target's
chat template), taken after the first --skip-per-category candidates of each
category, which `python -m infer.bench` and `python -m train.evaluate` measure:
the tables are held out from those measurements. The answers are computed once
and shared by the drafters.

--write stores the tables in the export's drafter.json ("calibration"; for a
shipped drafter, the one under dloop_jax/drafters/weights/), where
`load_drafter` finds them: a table of the same score and gamma is replaced,
tables of other gammas (--block-size) are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from train import drafter_flags


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m train.calibrate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  drafter_flags.add(p)
  p.add_argument("--weights", choices=("f32", "bf16"), default="f32",
                 help="the target's weight storage")
  p.add_argument("--prompts-per-category", type=int, default=8,
                 help="held-out prompts per category (math, code, chat)")
  p.add_argument("--skip-per-category", type=int, default=16,
                 help="candidates of each category left out first (those the benchmark uses)")
  p.add_argument("--max-new-tokens", type=int, default=96, help="answer length limit")
  p.add_argument("--max-prompt-tokens", type=int, default=512)
  p.add_argument("--max-stages", type=int, default=3,
                 help="stages drafted in a row at each answer position")
  p.add_argument("--block-size", type=int, default=None,
                 help="drafts per stage (default: each drafter's gamma)")
  p.add_argument("--stride", type=int, default=1,
                 help="draft at every N-th answer position (1: every position)")
  p.add_argument("--batch-size", type=int, default=8, help="rows per program")
  p.add_argument("--data-dir", default="",
                 help="where the ShareGPT held-out prompts are (or are built); '' = default")
  p.add_argument("--write", action="store_true",
                 help="store the tables in each export's drafter.json")
  p.add_argument("--json", default="", help="also write the tables to this JSON file")
  args = p.parse_args(argv)
  args.drafters = [d for d in args.drafters.split(",") if d]
  if not args.drafters:
    p.error("--drafters names no drafter")
  for flag in ("prompts_per_category", "max_new_tokens", "max_prompt_tokens", "max_stages",
               "block_size", "stride", "batch_size"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1")
  if args.skip_per_category < 0:
    p.error("--skip-per-category must be >= 0")
  return args


def held_out_prompts(tokenizer, *, per_category: int, skip: int, limit: int,
                     data_dir: str = "") -> list[tuple[int, ...]]:
  """Token ids of the first `per_category` prompts of each benchmark category that fit
  `limit` tokens, after its first `skip` candidates."""
  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import bench_prompts
  from dloop_jax.errors import ConfigError
  from dloop_jax.training import engine_eval
  # pylint: enable=g-import-not-at-top
  # `load` yields up to 4 * per_category candidates of a category, in its fixed order.
  candidates = bench_prompts.load(bench_prompts.CATEGORIES,
                                  per_category=-(-(skip + per_category) // 2),
                                  data_dir=data_dir or None)
  prompts = engine_eval.fitting_prompts(tokenizer, [(r.category, r.text) for r in candidates],
                                        per_group=per_category, limit=limit, skip=skip)
  if not prompts:
    raise ConfigError(f"No held-out prompt after the first {skip} of each category fits"
                      f" {limit} tokens.")
  return prompts


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  # Heavy imports after the arguments are checked.
  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import calibration as calibration_lib
  from dloop_jax.drafters import io as drafter_io
  from dloop_jax.errors import ConfigError, DLoopError
  from dloop_jax.models import load_target
  from dloop_jax.training import calibration
  # pylint: enable=g-import-not-at-top
  log = lambda line: print(line, flush=True)  # noqa: E731
  out = {}
  try:
    loaded = load_target(args.target, weights=args.weights)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
      raise ConfigError(f"Target {loaded.name!r} has no tokenizer; the prompts need one.")
    limit = min(args.max_prompt_tokens,
                int(loaded.model.config.max_position_embeddings) - args.max_new_tokens)
    prompts = held_out_prompts(tokenizer, per_category=args.prompts_per_category,
                               skip=args.skip_per_category, limit=limit, data_dir=args.data_dir)
    stops = tuple(int(t) for t in getattr(tokenizer, "stop_token_ids", ()) or ())
    log(f"[calibrate] {len(prompts)} held-out prompts (after the first"
        f" {args.skip_per_category} of each category), greedy answers of up to"
        f" {args.max_new_tokens} tokens, {args.max_stages} stages per position")
    answers = calibration.answers(loaded.model, prompts, max_new_tokens=args.max_new_tokens,
                                  stop_tokens=stops, batch_size=args.batch_size, log=log)
    for name in args.drafters:
      start = time.perf_counter()
      drafter = drafter_io.load_drafter(name, target=loaded.model)
      tables = calibration.measure(
          loaded.model, drafter, prompts, answer_tokens=answers,
          max_new_tokens=args.max_new_tokens, block_size=args.block_size,
          max_stages=args.max_stages, batch_size=args.batch_size, stride=args.stride,
          label=os.path.basename(os.path.normpath(name)), log=log)
      log(f"[calibrate] {name}: measured in {time.perf_counter() - start:.0f}s")
      for table in tables.values():
        print(f"\n{name}, {table.format()}\n", flush=True)
      out[name] = {key: table.to_json() for key, table in calibration_lib.named(tables).items()}
      if args.write:
        log(f"[calibrate] wrote {drafter_io.write_calibration(name, tables)}")
  except (DLoopError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(target=args.target, weights=args.weights, prompts=len(prompts),
                     skip_per_category=args.skip_per_category,
                     max_new_tokens=args.max_new_tokens, max_stages=args.max_stages,
                     stride=args.stride, tables=out), f, indent=1)
    log(f"[calibrate] tables in {os.path.abspath(args.json)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
