"""Engine acceptance length of drafters on held-out prompts, with head ablations.

    python -m train.evaluate --drafters smollm2-135m-instruct-block,runs/domino_all/best
    python -m train.evaluate --drafters runs/domino_all/best --heads-off   # + correction off

For each drafter (a shipped name, an export directory or a training workdir)
it runs greedy `generate()` over the benchmark's held-out prompts (math, code,
chat; the target's chat template) with every draft verified (no scheduler),
in `sd` and `dloop`, and prints τ = committed tokens per verification round
(and the share of dloop's rounds that drafted a second stage):
the trainer's `engine_tau_*` (`dloop_jax.training.engine_eval`) with more
prompts. With --heads-off, each head that the drafter has (DSpark's Markov
head, Domino's correction head) is also measured switched off
(`dloop_jax.drafters.ablation.without_head`): the rest of the drafter is the
trained one, so the difference is what the head adds at inference.

Run it with nothing else on the cores only when the seconds matter; τ does not
depend on timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--drafters", required=True,
                 help="comma-separated shipped drafter names, export directories or workdirs")
  p.add_argument("--target", default="smollm2-135m-instruct",
                 help="the target: registry name, .gguf or HF directory")
  p.add_argument("--heads-off", action="store_true",
                 help="also measure each drafter with each of its heads switched off")
  p.add_argument("--prompts", default="bench",
                 help="'bench' (the benchmark's held-out prompts) or a JSONL file with a"
                      " 'prompt' field per line")
  p.add_argument("--prompts-per-category", type=int, default=6,
                 help="'bench': prompts per category (a file: this many in all)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--max-prompt-tokens", type=int, default=512)
  p.add_argument("--modes", default="sd,dloop", help="comma-separated: sd, dloop")
  p.add_argument("--gate", type=float, default=-0.5, help="dloop's gate g")
  p.add_argument("--block-size", type=int, default=None,
                 help="dloop's drafts per stage (default: the drafter's gamma)")
  p.add_argument("--max-stages", type=int, default=None, help="dloop's S_max (default 3)")
  p.add_argument("--weights", choices=("f32", "bf16"), default="f32",
                 help="the target's weight storage")
  p.add_argument("--fixed-width", type=int, default=0,
                 help="every target forward this many tokens wide (0: as wide as its tokens)")
  p.add_argument("--tree-budget", type=int, default=0,
                 help="draft trees of this many nodes a stage (0: chains; drafters with trees)")
  p.add_argument("--data-dir", default="",
                 help="where the ShareGPT held-out prompts are (or are built); '' = default")
  p.add_argument("--json", default="", help="also write the rows to this JSON file")
  args = p.parse_args(argv)
  args.drafters = [d for d in args.drafters.split(",") if d]
  args.modes = tuple(m for m in args.modes.split(",") if m)
  if not args.drafters:
    p.error("--drafters names no drafter")
  if not args.modes or set(args.modes) - {"sd", "dloop"}:
    p.error(f"--modes must be a non-empty subset of sd,dloop; got {','.join(args.modes)!r}")
  for flag in ("prompts_per_category", "max_new_tokens", "max_prompt_tokens", "block_size",
               "max_stages"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1")
  for flag in ("fixed_width", "tree_budget"):
    if getattr(args, flag) < 0:
      p.error(f"--{flag.replace('_', '-')} must be >= 0")
  return args


def _table(rows: list[dict], modes: tuple[str, ...]) -> str:
  multi = "dloop" in modes
  head = ("| drafter | heads off | " + " | ".join(f"τ {m}" for m in modes)
          + (" | dloop rounds with 2+ stages" if multi else "") + " | seconds |")
  lines = [head, "|" + "---|" * (3 + len(modes) + multi)]
  for r in rows:
    cells = [f"{r[f'engine_tau_{m}']:.3f}" for m in modes]
    if multi:
      cells.append(f"{r['engine_multi_stage_dloop']:.1%}")
    lines.append(f"| {r['drafter']} | {r['heads_off'] or '-'} | {' | '.join(cells)}"
                 f" | {r['seconds']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  # Heavy imports after the arguments are checked.
  from dloop_jax.drafters import ablation  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.io import load_drafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import engine_eval  # pylint: disable=g-import-not-at-top

  try:
    target = load_target(args.target, weights=args.weights)
    evaluate = dataclasses.replace(
        engine_eval.from_config(
            dict(prompts=args.prompts, num_prompts=args.prompts_per_category,
                 max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                 modes=args.modes, gate=args.gate, data_dir=args.data_dir),
            target=target.model, tokenizer=target.tokenizer),
        block_size=args.block_size, max_stages=args.max_stages, fixed_width=args.fixed_width,
        tree_budget=args.tree_budget)
    print(f"{len(evaluate.prompts)} prompts, {args.max_new_tokens} new tokens, greedy, every"
          f" draft verified; modes {', '.join(args.modes)}; {args.weights} weights"
          + (f", width {args.fixed_width}" if args.fixed_width else "")
          + (f", trees of {args.tree_budget} nodes" if args.tree_budget else ""), flush=True)
    rows = []
    for name in args.drafters:
      drafter = load_drafter(name, target=target.model)
      variants = [("", drafter)]
      if args.heads_off:
        variants += [(head, ablation.without_head(drafter, head))
                     for head in ablation.heads(drafter)]
      for off, variant in variants:
        start = time.perf_counter()
        taus = evaluate(target.model, variant)
        row = dict(drafter=name, heads_off=off, seconds=time.perf_counter() - start,
                   **{k: v for k, v in taus.items() if k != "engine_eval_s"})
        rows.append(row)
        print(json.dumps(row), flush=True)
  except (DLoopError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(_table(rows, args.modes))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(prompts=len(evaluate.prompts), max_new_tokens=args.max_new_tokens,
                     gate=args.gate, block_size=args.block_size, max_stages=args.max_stages,
                     weights=args.weights, fixed_width=args.fixed_width,
                     tree_budget=args.tree_budget, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
