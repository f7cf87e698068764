"""Engine acceptance length of drafters on held-out prompts, with head ablations, and the
teacher-forced held-out metric beside it.

    python -m train.evaluate --drafters smollm2-135m-instruct-block,runs/domino_all/best
    python -m train.evaluate --drafters runs/domino_all/best --heads-off   # + correction off
    python -m train.evaluate --drafters runs/block/best --heldout-data DATASET \
        --heldout-examples 128 --heldout-config configs/smollm2_block.py:cpu10k

For each drafter (a shipped name, an export directory or a training workdir)
it runs greedy `generate()` over the benchmark's held-out prompts (math, code,
chat; the target's chat template) with every draft verified (no scheduler;
--schedule cost: the scheduler's choice, as `python -m infer` decodes; --lookup
prompt: with prompt-lookup drafts), in `sd` and `dloop`, and prints
τ = committed tokens per verification round
(and the share of dloop's rounds that drafted a second stage):
the trainer's `engine_tau_*` (`dloop_jax.training.engine_eval`) with more
prompts. With --heads-off, each head that the drafter has (DSpark's Markov
head, Domino's correction head) is also measured switched off
(`dloop_jax.drafters.ablation.without_head`): the rest of the drafter is the
trained one, so the difference is what the head adds at inference.

With --heldout-data, each drafter is also measured teacher-forced on the last
--heldout-examples examples of that dataset's training split: the examples a
run with `data.heldout_examples` of the same count never trained on (the same
split rule, `pipeline.heldout_batches`), in the training data's own domain.
It reports heldout acc_1..K, the τ they imply and the standard error of each
(`dloop_jax.training.heldout`): the trainer's `heldout_*` metrics, which a run
with the same settings logs for the same drafter. The drafts measured are those
of --heldout-config's objective (a training config: its objective, objective
settings, row length and compute dtype; default the base config with the
objective the export names), so measure drafters of one A/B with one config.

Run it with nothing else on the cores only when the seconds matter; τ does not
depend on timing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import os
import sys
import time

from train import drafter_flags


# The decoding options this command takes, named after `DecodingConfig`'s fields.
DECODING_FLAGS = ("gate", "block_size", "max_stages", "fixed_width", "tree_budget", "schedule",
                  "lookup", "draft_backoff", "confidence", "costs")


def _parse(argv):
  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags
  from dloop_jax.training import engine_eval
  # pylint: enable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  drafter_flags.add(p)
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
  p.add_argument("--weights", choices=("f32", "bf16"), default="f32",
                 help="the target's weight storage")
  p.add_argument("--data-dir", default="",
                 help="where the ShareGPT held-out prompts are (or are built); '' = default")
  p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                 help="measure engine τ (--no-engine: the held-out metric only)")
  p.add_argument("--heldout-data", default="",
                 help="a dataset built with `python -m train.data` (features of the drafters'"
                      " taps): also report the teacher-forced held-out metric on it")
  p.add_argument("--heldout-examples", type=int, default=128,
                 help="the last N examples of its training split (as data.heldout_examples=N)")
  p.add_argument("--heldout-config", default="",
                 help="FILE[:RECIPE] training config whose objective, objective_cfg,"
                      " data.seq_len and compute_dtype the held-out drafts follow"
                      " ('' = the base config with the export's objective)")
  p.add_argument("--heldout-batch-size", type=int, default=None,
                 help="held-out rows per forward (default: --heldout-config's data.batch_size,"
                      " else 8). The block drafters' anchors are drawn per batch, so the"
                      " trainer's heldout_* values are reproduced at its batch size")
  p.add_argument("--json", default="", help="also write the rows to this JSON file")
  decoding = p.add_argument_group(
      "decoding (fields of dloop_jax.DecodingConfig; defaults: the trainer's evaluation,"
      " dloop_jax.training.engine_eval.EVAL_DECODING)")
  flags.add(decoding, DECODING_FLAGS, base=engine_eval.EVAL_DECODING, help=dict(
      block_size="dloop's drafts per stage (default: the drafter's gamma; sd always drafts"
                 " the drafter's)",
      schedule="off: every draft verified (τ is the drafter's); cost: the scheduler's choice,"
               " as python -m infer runs at free widths (τ is what users get) (default: off)"))
  args = p.parse_args(argv)
  args.drafters = [d for d in args.drafters.split(",") if d]
  args.modes = tuple(m for m in args.modes.split(",") if m)
  if not args.drafters:
    p.error("--drafters names no drafter")
  if not args.modes or set(args.modes) - {"sd", "dloop"}:
    p.error(f"--modes must be a non-empty subset of sd,dloop; got {','.join(args.modes)!r}")
  if not args.engine and not args.heldout_data:
    p.error("--no-engine leaves nothing to measure: give --heldout-data")
  for flag in ("prompts_per_category", "max_new_tokens", "max_prompt_tokens",
               "heldout_examples", "heldout_batch_size"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1")
  try:
    args.decoding = engine_eval.decoding(flags.given(args))
  except ValueError as e:  # a ConfigError naming the flag's field
    p.error(flags.as_flags(str(e).replace("eval.decoding: ", "")))
  return args


def _table(rows: list[dict], modes: tuple[str, ...]) -> str:
  multi = "dloop" in modes
  heldout = any("heldout_tau" in r for r in rows)
  engine = any(f"engine_tau_{m}" in r for r in rows for m in modes)
  head = "| drafter | heads off | "
  cols = 2
  if heldout:
    head += "heldout τ ± SE | heldout acc_k | "
    cols += 2
  if engine:
    head += (" | ".join(f"τ {m}" for m in modes) + " | "
             + ("dloop rounds with 2+ stages | " if multi else "") + "seconds |")
    cols += len(modes) + multi + 1
  lines = [head.rstrip(" |") + " |", "|" + "---|" * cols]
  for r in rows:
    cells = [r["drafter"], r["heads_off"] or "-"]
    if heldout:
      if "heldout_tau" in r:
        k = sum(1 for key in r if key.startswith("heldout_acc_") and not key.endswith("_se"))
        cells += [f"{r['heldout_tau']:.3f} ± {r['heldout_tau_se']:.3f}",
                  " / ".join(f"{r[f'heldout_acc_{j}']:.3f}" for j in range(1, k + 1))]
      else:
        cells += ["", ""]
    if engine:
      cells += [f"{r[f'engine_tau_{m}']:.3f}" for m in modes]
      if multi:
        cells.append(f"{r['engine_multi_stage_dloop']:.1%}")
      cells.append(f"{r['seconds']:.0f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _config_file(spec: str):
  """FILE[:RECIPE] -> the ConfigDict its get_config returns."""
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  path, recipe = spec, None
  if not os.path.exists(path) and ":" in spec:
    path, recipe = spec.rsplit(":", 1)
  if not os.path.isfile(path):
    raise ConfigError(f"--heldout-config: config file {path!r} does not exist; give a training"
                      " config as FILE[:RECIPE], e.g. configs/smollm2_block.py:cpu10k.")
  module_spec = importlib.util.spec_from_file_location("_heldout_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(recipe) if recipe is not None else module.get_config()


def heldout_metrics(source: str, *, target, data: str, examples: int, config=None,
                    batch_size: int = 8) -> dict[str, float]:
  """The teacher-forced held-out metric of one drafter (`Trainer.heldout_metrics`).

  Args:
    source: a shipped drafter name, an export directory or a training workdir.
    target: the `hooks.Target` it drafts for.
    data: a dataset directory (`python -m train.data`) holding the drafter's taps.
    examples: how many of the training split's last examples are held out, as
      `data.heldout_examples` of the run.
    config: a training config: the objective, objective settings, row length,
      compute dtype and seed (the block drafters' anchor key) of the drafts
      measured; None = the base config with the objective the export names.
    batch_size: held-out rows per forward.

  Returns:
    {"heldout_acc_k", "heldout_acc_k_se", "heldout_tau", "heldout_tau_se",
    "heldout_examples"} (`dloop_jax.training.heldout.summarize`).
  """
  # pylint: disable=g-import-not-at-top
  from ml_collections import ConfigDict
  from dloop_jax.drafters import io as drafter_io
  from dloop_jax.training import config as config_lib
  from dloop_jax.training import hooks as hooks_lib
  from dloop_jax.training import trainer as trainer_lib
  # pylint: enable=g-import-not-at-top
  export = drafter_io.resolve(source)
  info = drafter_io.read_info(export)
  c = config_lib.base_config() if config is None else copy.deepcopy(config)
  if config is None:
    c.objective = info.get("extra", {}).get("objective", c.objective)
  with c.unlocked():
    # The export's own drafter (a restricted draft vocabulary included).
    c.drafter = ConfigDict(info["drafter_config"])
  c.init_from = ""
  c.data.source, c.data.path, c.data.online = "path", data, False
  c.data.heldout_examples, c.data.batch_size = int(examples), int(batch_size)
  c.eval.every_steps, c.eval.heldout_every_steps = 0, 0
  hooks = dataclasses.replace(hooks_lib.default_hooks(), build_target=lambda _: target)
  trainer = trainer_lib.Trainer(c, hooks=hooks)
  trainer.init_from(export)
  hooks_lib.default_check_dataset(data, drafter=trainer.drafter, target=target)
  batches = hooks_lib.default_heldout_batches(c, data_info=data, batch_size=int(batch_size),
                                              shard_index=0, shard_count=1)
  return trainer.heldout_metrics(batches)


def evaluate(args: argparse.Namespace, *, target) -> list[dict]:
  """The rows of `args.drafters` (and their heads off) for `target` (a `hooks.Target`)."""
  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags
  from dloop_jax.drafters import ablation
  from dloop_jax.drafters.io import load_drafter
  from dloop_jax.training import engine_eval
  # pylint: enable=g-import-not-at-top
  evaluator = None
  d = args.decoding
  if args.engine:
    evaluator = engine_eval.from_config(
        dict(prompts=args.prompts, num_prompts=args.prompts_per_category,
             max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
             modes=args.modes, data_dir=args.data_dir, decoding=flags.given(args)),
        target=target.model, tokenizer=target.tokenizer)
    verified = ("every draft verified" if d.schedule == "off" else
                "the cost scheduler's verification")
    print(f"{len(evaluator.prompts)} prompts, {args.max_new_tokens} new tokens, greedy, {verified}"
          + (", prompt lookup" if d.lookup == "prompt" else "")
          + f"; modes {', '.join(args.modes)}; {args.weights} weights"
          + (f", width {d.fixed_width}" if d.fixed_width else "")
          + (f", trees of {d.tree_budget} nodes" if d.tree_budget else ""), flush=True)
  config = _config_file(args.heldout_config) if args.heldout_config else None
  if args.heldout_data:
    print(f"held out: the last {args.heldout_examples} examples of {args.heldout_data},"
          f" teacher-forced ({args.heldout_config or 'the export objective'})", flush=True)
  rows = []
  for name in args.drafters:
    held = {}
    if args.heldout_data:
      start = time.perf_counter()
      held = heldout_metrics(name, target=target, data=args.heldout_data,
                             examples=args.heldout_examples, config=config,
                             batch_size=args.heldout_batch_size or (
                                 int(config.data.batch_size) if config is not None else 8))
      held["heldout_s"] = time.perf_counter() - start
    if evaluator is None:
      rows.append(dict(drafter=name, heads_off="", **held))
      print(json.dumps(rows[-1]), flush=True)
      continue
    drafter = load_drafter(name, target=target.model)
    variants = [("", drafter)]
    if args.heads_off:
      variants += [(head, ablation.without_head(drafter, head))
                   for head in ablation.heads(drafter)]
    for off, variant in variants:
      start = time.perf_counter()
      taus = evaluator(target.model, variant)
      row = dict(drafter=name, heads_off=off, seconds=time.perf_counter() - start,
                 **{k: v for k, v in taus.items() if k != "engine_eval_s"},
                 **(held if not off else {}))
      rows.append(row)
      print(json.dumps(row), flush=True)
  args.num_prompts = len(evaluator.prompts) if evaluator is not None else 0
  return rows


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  # Heavy imports after the arguments are checked.
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import load_target  # pylint: disable=g-import-not-at-top
  from dloop_jax.training.hooks import Target  # pylint: disable=g-import-not-at-top

  try:
    if args.engine and args.prompts not in ("bench", "random"):
      # A missing or malformed prompts file fails before the target loads (as in
      # python -m infer --prompts-file).
      from dloop_jax import prompt_files  # pylint: disable=g-import-not-at-top
      prompt_files.read_prompts(args.prompts)
    loaded = load_target(args.target, weights=args.weights)
    target = Target(model=loaded.model, name=loaded.name, tokenizer=loaded.tokenizer)
    rows = evaluate(args, target=target)
  except (DLoopError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(_table(rows, args.modes))
  if args.json:
    with open(args.json, "w") as f:
      d = args.decoding
      json.dump(dict(prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                     gate=d.gate, block_size=d.block_size, max_stages=d.max_stages,
                     weights=args.weights, fixed_width=d.fixed_width,
                     tree_budget=d.tree_budget, heldout_data=args.heldout_data,
                     heldout_examples=args.heldout_examples if args.heldout_data else 0,
                     heldout_config=args.heldout_config, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
