"""`python -m infer.bench`: DLoop against autoregressive, standard speculative decoding and HF.

    python -m infer.bench --out bench_out                   # 20 prompts per category, 256 tokens
    python -m infer.bench --quick --out bench_out           # 3 prompts per category
    python -m infer.bench --drafters NAME_OR_PATH,... --sweep --out bench_out
    python -m infer.bench --quick --no-drafters --max-new-tokens 128   # our ar vs transformers
    python -m infer.bench --quick --weights f32,bf16 --fixed-widths 5    # both weight storages
    python -m infer.bench --quick --modes sd --lookups off,prompt   # without and with prompt lookup

Methods, measured in one run on the same prompts, interleaved per prompt (the
order rotates from prompt to prompt) after a warm-up: our `ar`; for every
drafter our `sd` and `dloop` (see --modes) with the same gamma (the drafter's trained block
size unless --block-size), verifying the prefix of the drafts that pays (the
scheduler, `sd` / `dloop`) and every draft (`sd/all` / `dloop/all`), see
--schedules; with --tree-budgets, the same with draft trees of B nodes per
stage (`sd/treeB`, `dloop/treeB`, and `/all`); HF transformers (PyTorch) greedy `generate()` and
its prompt-lookup decoding on the same weights and threads; llama.cpp on the
same GGUF and threads, computing with its quantized weights, when the optional
extra is installed (pip install -e '.[llama-cpp]'; without it one line says so);
--peers picks among them, --no-peers leaves them out. Greedy by default; every
output is compared with our `ar` output (identical, or differing only after a
near-tie of the target, docs/design.md §The near-tie rule): required of ours,
reported for the peers.
With --weights f32,bf16 every method of ours also runs on a target whose weight
matrices are stored in bf16 (`ar@bf16`, `sd/all/w5@bf16`, ...), timed against the
f32 `ar` and checked against the bf16 `ar` (at the same fixed width, if any).

Writes DIR/results.json (`rows`: one per category x method x drafter, plus
`overall`; `records`: one per prompt x method; `sweep`), DIR/results.md and
DIR/speedup.png (and DIR/gate_sweep.png with --sweep, DIR/trees.png with tree budgets: τ and
tokens/s against the budget per drafter). The table's "modeled speedup" is the
speedup on an accelerator where every forward costs one step whatever its
width (`report.modeled_speedup`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _names(text: str) -> list[str]:
  """The items of a comma-separated flag, stripped, empty ones dropped."""
  return [x.strip() for x in text.split(",") if x.strip()]


def _gates(text: str) -> list[float | str]:
  from dloop_jax.decoding import arguments  # pylint: disable=g-import-not-at-top
  return [arguments.parse_gate(x) for x in _names(text)]


def _ints(text: str) -> list[int]:
  return [int(x) for x in _names(text)]


def _parse(argv):
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct",
                 help="registry name or .gguf path (the HF peers need a GGUF file)")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--drafters", default="",
                     help="comma-separated drafter names / export dirs (default: every drafter"
                          " shipped for the target)")
  which.add_argument("--no-drafters", action="store_true",
                     help="no speculative methods: our ar against the transformers peers only")
  p.add_argument("--categories", default="math,code,chat")
  p.add_argument("--prompts-per-category", type=int, default=20)
  p.add_argument("--quick", action="store_true", help="3 prompts per category")
  p.add_argument("--max-new-tokens", type=int, default=256)
  p.add_argument("--max-prompt-tokens", type=int, default=512,
                 help="skip prompts longer than this (after the chat template)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--weights", type=_names, default=None,
                 help="storage of our target's weight matrices: f32, bf16 and / or int8. With"
                      " more than one (f32,bf16,int8), every method of ours also runs on the"
                      " others (methods named ...@bf16) against the first's ar. Default: f32, plus"
                      " the profile's weights when they are 16-bit (what python -m infer runs"
                      " by default)")
  p.add_argument("--modes", default="sd,dloop",
                 help="speculative modes to run with each drafter: sd and / or dloop (our ar,"
                      " the reference of every comparison, always runs)")
  p.add_argument("--schedules", default="cost,off",
                 help="verification schedules of sd / dloop: cost (the prefix that pays; methods"
                      " sd, dloop) and off (every draft; sd/all, dloop/all)")
  p.add_argument("--confidences", type=_names, default=["auto"],
                 help="what the cost scheduler reads as each draft's confidence c_k: auto (the"
                      " drafter's learned confidence where it has one, e.g. DSpark's head; else"
                      " its top draft probabilities) and / or probability (the top draft"
                      " probabilities always: methods sd~prob, dloop~prob, run for drafters"
                      " with a learned confidence only)")
  p.add_argument("--lookups", type=_names, default=None,
                 help="off and / or prompt: chains of sd / dloop without and with the"
                      " prompt-lookup stage (methods named ...+lookup; greedy only); default:"
                      " python -m infer's (prompt when greedy, off when sampling); the gate"
                      " sweep runs the first")
  p.add_argument("--tree-budgets", type=_ints, default=[0],
                 help="comma-separated draft tree budgets B (nodes per stage) of sd / dloop; 0"
                      " is the chain (e.g. 0,8,16,32; drafters with draft trees only)")
  p.add_argument("--tree-schedules", default="off",
                 help="verification schedules of the tree rows: off (the whole tree;"
                      " sd/treeB/all, dloop/treeB/all) and / or cost (the best nodes that pay)")
  p.add_argument("--fixed-widths", type=_ints, default=None,
                 help="also run our ar at each fixed forward width W (ar/wW), and sd / dloop"
                      " at the smallest W that holds their verification (mode/all/wW: every"
                      " target forward W tokens wide, every draft verified; outputs must equal"
                      " ar/wW's bit for bit, bf16 weights included; docs/decoding.md)."
                      " Default: the profile's fixed width when its weights are 16-bit, else"
                      " none")
  p.add_argument("--repeats", type=int, default=1,
                 help="time each prompt this many times, the methods interleaved, and keep"
                      " each method's median run (steadier ratios on a noisy machine)")
  peers = p.add_mutually_exclusive_group()
  peers.add_argument("--peers", type=_names, default=None,
                     help="comma-separated peers among hf (transformers greedy), hf_pld"
                          " (its prompt lookup) and llama_cpp (llama.cpp; the optional extra"
                          " llama-cpp). Default: all three, llama_cpp when installed")
  peers.add_argument("--no-peers", action="store_true", help="leave out every peer")
  p.add_argument("--pld-tokens", type=int, default=10,
                 help="prompt-lookup decoding: draft tokens per step (transformers' default 10)")
  p.add_argument("--sweep", action="store_true",
                 help="also sweep DLoop's gate and S_max (writes gate_sweep.png)")
  p.add_argument("--sweep-gates", type=_gates, default=_gates("-2,-1,-0.75,-0.5,-0.25,0"),
                 help="gates of the sweep: numbers and / or auto (the calibrated rule)")
  p.add_argument("--sweep-costs", type=_names, default=["machine"],
                 help="cost tables the sweep runs every gate under: machine (this machine's,"
                      " as the main run) and / or gpu (the gpu profile's nearly flat table:"
                      " the accelerator the modeled speedup stands for, for the scheduler"
                      " and gate auto alike)")
  p.add_argument("--sweep-max-stages", type=_ints, default=_ints("2,3,4"))
  p.add_argument("--sweep-prompts", type=int, default=2,
                 help="prompts per category of the main run reused by the sweep")
  p.add_argument("--data-dir", default=None, help="where the ShareGPT dataset is (or is built)")
  p.add_argument("--out", default="bench_out", help="output directory")
  decoding = p.add_argument_group(
      "decoding (fields of dloop_jax.DecodingConfig, for every method of ours)")
  flags.add(decoding, ("profile", "block_size", "gate", "max_stages", "draft_backoff", "costs"),
            sampling=True, help=dict(
                profile="backend profile of our targets (precision, product forms, the default"
                        " --weights / --fixed-widths); default: this backend's. 'gpu' on a CPU"
                        " checks an accelerator's configuration",
                block_size="gamma for sd and dloop (default: each drafter's trained block"
                           " size; dloop at a fixed width without it: the loop the width"
                           " verifies whole)",
                costs="JSON cost table for the scheduler (default: $DLOOP_COSTS, else the"
                      " target's cached table, measured on first use)"))
  args = p.parse_args(argv)
  if not args.sweep_costs or set(args.sweep_costs) - {"machine", "gpu"}:
    p.error(f"--sweep-costs takes machine and / or gpu, got {','.join(args.sweep_costs)!r}")
  return args


def _lookups(given: list[str] | None, sampling) -> list[str]:
  """--lookups, or python -m infer's default (lookup="auto") for the benchmark's chains."""
  if given is not None:
    return given
  from dloop_jax.decoding import lookup as lookup_lib  # pylint: disable=g-import-not-at-top
  return [lookup_lib.resolve("auto", mode="dloop", greedy=sampling.greedy, tree_budget=0)]


def _profile_defaults(args) -> None:
  """--weights and --fixed-widths left unset: what `python -m infer` runs by default on this
  machine is among the methods (f32 reference, plus the profile's 16-bit weights at its
  fixed width)."""
  from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
  profile = profiles.resolve(args.profile)
  sixteen = profile.weights != "f32"
  if args.weights is None:
    args.weights = ["f32"] + ([profile.weights] if sixteen else [])
  if args.fixed_widths is None:
    args.fixed_widths = [profile.fixed_width] if sixteen else []
  _log(f"[bench] profile {profile.name}: {profile.why}")


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _machine(threads: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  info = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
              cpu_count=os.cpu_count(), python=platform.python_version(), jax=jax.__version__,
              devices=[str(d) for d in jax.devices()], torch_threads=threads)
  try:
    import torch  # pylint: disable=g-import-not-at-top
    info["torch"] = torch.__version__
  except ImportError:
    pass
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top
    info["llama_cpp"] = llama_cpp.__version__
  except ImportError:
    pass
  return info


def _record(prompt, method, run, *, prompt_len: int) -> dict:
  """One prompt under one method: what it is, its run's statistics (`methods.Run.record`)."""
  return dict(category=prompt.category, set=prompt.set_name, prompt_id=prompt.id,
              prompt_tokens=prompt_len, method=method.method_name,
              drafter=getattr(method, "drafter_label", "") or "",
              **run.record(), seconds=run.seconds, compile_seconds=run.compile_seconds,
              tree_budget=getattr(method, "tree_budget", 0),
              mode=getattr(method, "method", method.method_name),
              draft_cost_ratio=_draft_cost_ratio(getattr(method, "drafter", None),
                                                 getattr(method, "target", None)),
              tokens=run.tokens)


def _ratio(x) -> str:
  return f"{x:.2f}x" if x else "-"


def _draft_cost_ratio(drafter, target) -> float:
  """Modeled cost of a drafter forward in target steps: its decoder layers / the target's.

  On an accelerator decoding is weight-streaming bound and a forward of a few
  tokens costs about one step; the heads (shared embedding / LM head) are left
  out for both.
  """
  if drafter is None or target is None:
    return 0.0
  layers = getattr(getattr(drafter, "spec", None), "num_layers", 1)
  return layers / target.config.num_layers


def _check_against_ar(target, prompt_ids, ar_tokens, rec, *, greedy: bool) -> None:
  from dloop_jax.decoding import lossless  # pylint: disable=g-import-not-at-top
  if not greedy:
    rec.update(identical_to_ar=None, lossless_vs_ar=None)
    return
  cmp = lossless.compare(target, prompt_ids, ar_tokens, rec["tokens"])
  rec.update(identical_to_ar=cmp.identical, lossless_vs_ar=cmp.lossless,
             first_difference=cmp.first_difference, top2_gap=cmp.top2_gap)


def _cost_table(args, target, *, weights: str):
  """The scheduler's cost table of `target` (--costs, $DLOOP_COSTS or its cached table)."""
  from dloop_jax.decoding import costs as costs_lib  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  table = (costs_lib.as_table(args.costs) if args.costs else
           costs_lib.load(os.environ["DLOOP_COSTS"]) if os.environ.get("DLOOP_COSTS") else
           costs_lib.for_target(target, batch_size=1))
  _log(f"[bench] cost table{f' ({weights})' if weights else ''}"
       f" ({time.perf_counter() - t0:.1f}s):\n{table.format()}")
  return table


def _our_methods(args, *, base, target, drafters, weights: str, modes, schedules,
                 tree_schedules, fixed_widths, common) -> list:
  """Our methods on one target: ar, then per drafter sd / dloop per schedule and tree budget,
  and the fixed widths. `base` holds the decoding flags given; `weights` names a target other
  than the reference ("": the reference).

  Each method is a candidate `DecodingConfig`; one that `decoding.config.resolve` refuses
  for this target and drafter is left out with the refusal in one line.
  """
  from dloop_jax.decoding import arguments  # pylint: disable=g-import-not-at-top
  from infer.bench import methods as methods_lib  # pylint: disable=g-import-not-at-top

  common = dict(common, target=target, weights=weights)
  methods = []

  def add(config, drafter=None, label="") -> None:
    """Adds the method of `config`, unless resolve refuses it (then logs why)."""
    method = methods_lib.Ours(decoding=config, drafter=drafter, drafter_label=label, **common)
    refusal = _refusal(config, target=target, drafter=drafter)
    if refusal:
      _log(f"[bench] {label + ': ' if label else ''}{method.method_name} skipped: {refusal}")
    else:
      methods.append(method)

  # A 16-bit target's rows at free widths are marked, not refused (`generate(allow_inexact=)`).
  free = base.replace(fixed_width=0, allow_inexact=arguments.is_16_bit(target))
  costs = None
  if "cost" in schedules + (tree_schedules if any(args.tree_budgets) else []) and drafters:
    costs = _cost_table(args, target, weights=weights)
  add(base.replace(mode="ar", fixed_width=0))
  for label, d in drafters:
    gamma = base.block_size or d.block_size
    for budget in dict.fromkeys(args.tree_budgets):
      if budget and not d.supports_trees:
        _log(f"[bench] {label}: no draft trees ({d.name}); tree budget {budget} skipped")
        continue
      for mode in modes:
        if budget and mode == "dloop" and budget < gamma:
          # Runnable, but a stage's tree narrower than a chain is not worth measuring.
          _log(f"[bench] {label}: dloop trees need a budget >= gamma ({gamma});"
               f" budget {budget} skipped")
          continue
        for schedule in (tree_schedules if budget else schedules):
          # The confidence source matters to the chain's cost scheduler alone, and differs
          # only for a drafter with a learned confidence.
          learned = schedule == "cost" and not budget and d.has_confidence
          for confidence in (args.confidences if learned else ["auto"]):
            for lookup in (args.lookups if not budget else ["off"]):  # chains only
              add(free.replace(mode=mode, schedule=schedule, costs=costs, tree_budget=budget,
                               confidence=confidence, lookup=lookup), d, label)
  for width in fixed_widths:
    add(base.replace(mode="ar", fixed_width=width))
  for label, d in (drafters if fixed_widths else ()):
    for mode in modes:
      for lookup in args.lookups:
        # The narrowest width that holds the mode's verification (dloop without a block
        # size: the loop the width verifies whole, python -m infer's default at W = 5).
        candidates = [base.replace(mode=mode, schedule="off", fixed_width=w, lookup=lookup)
                      for w in fixed_widths]
        fits = next((c for c in candidates
                     if not _refusal(c, target=target, drafter=d)), candidates[-1])
        add(fits, d, label)
  return methods


def _refusal(config, *, target, drafter) -> str:
  """Why `decoding.config.resolve` refuses `config` for `target` and `drafter` ("": it
  does not)."""
  from dloop_jax.decoding import config as config_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  try:
    config_lib.resolve(config, target=target, drafter=drafter)
  except DLoopError as e:
    return str(e)
  return ""


def main(argv=None) -> int:
  args = _parse(argv)
  from infer import enable_compilation_cache  # pylint: disable=g-import-not-at-top
  enable_compilation_cache()

  from dloop_jax.decoding import engine  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import flags  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.models import registry  # pylint: disable=g-import-not-at-top
  from dloop_jax import recorded_paths  # pylint: disable=g-import-not-at-top
  from infer.bench import llama_cpp_peer  # pylint: disable=g-import-not-at-top
  from infer.bench import methods as methods_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.data import bench_prompts as prompts_lib  # pylint: disable=g-import-not-at-top
  from infer.bench import report  # pylint: disable=g-import-not-at-top

  try:
    base = flags.config(args)  # the decoding flags given, on DecodingConfig's defaults
    flags.check(base.replace(mode="dloop"))
    sampling = base.sampling
    per_category = 3 if args.quick else args.prompts_per_category
    if per_category < 1:
      raise DLoopError("--prompts-per-category must be >= 1.")
    if args.repeats < 1:
      raise DLoopError(f"--repeats must be >= 1, got {args.repeats}.")
    # Flags first: a bad value fails before the target loads.
    modes = _names(args.modes)
    if not modes or any(x not in ("sd", "dloop") for x in modes):
      raise DLoopError(f"--modes takes sd and / or dloop, got {args.modes!r}.")
    schedules = _names(args.schedules)
    if not schedules or any(x not in ("cost", "off") for x in schedules):
      raise DLoopError(f"--schedules takes cost and / or off, got {args.schedules!r}.")
    if any(b < 0 for b in args.tree_budgets):
      raise DLoopError(f"--tree-budgets takes budgets >= 0, got {args.tree_budgets}.")
    args.lookups = _lookups(args.lookups, sampling)
    if not args.lookups or any(x not in ("off", "prompt") for x in args.lookups):
      raise DLoopError(f"--lookups takes off and / or prompt, got {','.join(args.lookups)!r}.")
    if "prompt" in args.lookups and not sampling.greedy:
      raise DLoopError("--lookups prompt runs greedy decoding only (temperature 0).")
    if not args.confidences or any(x not in ("auto", "probability") for x in args.confidences):
      raise DLoopError("--confidences takes auto and / or probability, got"
                       f" {','.join(args.confidences)!r}.")
    if args.peers is not None and any(x not in methods_lib.PEERS for x in args.peers):
      raise DLoopError(f"--peers takes {', '.join(methods_lib.PEERS)}, got"
                       f" {','.join(args.peers)!r}.")
    tree_schedules = _names(args.tree_schedules)
    if any(x not in ("cost", "off") for x in tree_schedules):
      raise DLoopError(f"--tree-schedules takes cost and / or off, got {args.tree_schedules!r}.")
    _profile_defaults(args)
    if any(w < 1 for w in args.fixed_widths):
      raise DLoopError(f"--fixed-widths takes widths >= 1, got {args.fixed_widths}.")
    fixed_widths = sorted(set(args.fixed_widths))
    if (not args.weights or len(set(args.weights)) != len(args.weights)
        or any(w not in ("f32", "bf16", "int8") for w in args.weights)):
      raise DLoopError(f"--weights takes f32, bf16 and / or int8 (the first is the reference),"
                       f" got {','.join(args.weights)!r}.")
    t0 = time.perf_counter()
    targets = {w: registry.load_target(args.target, weights=w, profile=args.profile)
               for w in args.weights}
    target = targets[args.weights[0]]  # the reference: its ar is every method's baseline
    tok = target.tokenizer
    if tok is None:
      raise DLoopError(f"Target {target.name!r} has no tokenizer; the benchmark needs one.")
    stops = list(tok.stop_token_ids)
    _log(f"[bench] target {target.name} loaded in {time.perf_counter() - t0:.1f}s"
         f" (weights {', '.join(args.weights)})")

    names = _names(args.drafters) or drafter_io.shipped_drafters_for(
        target.model.config)
    if args.no_drafters:
      names = []
    drafters_of = {w: [] for w in args.weights}  # each target's own drafter instances
    for name in names:
      label = os.path.basename(os.path.normpath(name))
      if label in ("export", "best"):  # a run's exports: name them by their run
        label = os.path.basename(os.path.dirname(os.path.normpath(name)))
      for w, t in targets.items():
        drafters_of[w].append((label, drafter_io.load_drafter(name, target=t.model)))
      d = drafters_of[args.weights[0]][-1][1]
      _log(f"[bench] drafter {label}: {d.name}, block size {d.block_size}")
    drafters = drafters_of[args.weights[0]]
    if not drafters:
      _log("[bench] no drafter for this target: measuring ar and the peers only")

    categories = _names(args.categories)
    candidates = prompts_lib.load(categories, per_category=per_category, data_dir=args.data_dir)
    prompts, skipped = [], 0
    counts = {c: 0 for c in categories}
    for p in candidates:
      if counts[p.category] >= per_category:
        continue
      ids = tok.apply_chat_template([{"role": "user", "content": p.text}],
                                    add_generation_prompt=True)
      if len(ids) > args.max_prompt_tokens:
        skipped += 1
        continue
      prompts.append((p, ids))
      counts[p.category] += 1
    _log(f"[bench] {len(prompts)} prompts ({counts}); {skipped} skipped as longer than"
         f" {args.max_prompt_tokens} tokens")

    common = dict(max_new_tokens=args.max_new_tokens, stop_tokens=stops, seed=args.seed)
    methods = []
    for w, t in targets.items():
      methods += _our_methods(args, base=base, target=t.model, drafters=drafters_of[w],
                              weights="" if w == args.weights[0] else w, modes=modes,
                              schedules=schedules,
                              tree_schedules=tree_schedules, fixed_widths=fixed_widths,
                              common=common)
    costs = next((m.costs for m in methods if m.costs is not None and not m.weights), None)
    threads = os.cpu_count() or 1
    methods += _peers(args, source=target.source, pad_token_id=tok.pad_token_id,
                      threads=threads, common=dict(common, sampling=sampling))

    # Prompts of one program shape together: the programs of a group are freed before the
    # next group's compile (`clear_compiled`), so that many methods over many shapes do
    # not hold every compiled program at once (each holds memory mappings, of which a
    # process may have only so many: vm.max_map_count).
    # The sort is stable: within a group, the prompts' order.
    ordered = sorted(prompts, key=lambda pair: plan_lib.prompt_width(len(pair[1])))
    # Warm-up: compile our programs for the first prompt's shapes, warm up torch.
    _log(f"[bench] warm-up of {len(methods)} methods")
    first_compile = {}
    for m in methods:
      first_compile[m.label] = m.run(ordered[0][1]).compile_seconds

    # Each output's reference: our ar on the same weights, at the same fixed width
    # if any (bit-identical outputs).
    def ar_key(m):
      return getattr(m, "weights", ""), getattr(m, "fixed_width", 0)

    records = []
    for i, (p, ids) in enumerate(ordered):
      if i and plan_lib.prompt_width(len(ids)) != plan_lib.prompt_width(len(ordered[i - 1][1])):
        engine.clear_compiled()  # the previous group's programs do not run again
      runs = methods_lib.interleaved_runs(methods, ids, repeats=args.repeats, rotation=i)
      recs = [_record(p, m, runs[id(m)], prompt_len=len(ids)) for m in methods]
      ar_tokens = {ar_key(m): rec["tokens"] for m, rec in zip(methods, recs)
                   if getattr(m, "method", "") == "ar"}
      for m, rec in zip(methods, recs):
        _check_against_ar(getattr(m, "target", target.model), ids, ar_tokens[ar_key(m)], rec,
                          greedy=sampling.greedy)
      records.extend(recs)
      parts = []
      for m, rec in zip(methods, recs):
        tps = rec["new_tokens"] / rec["seconds"] if rec["seconds"] else 0.0
        tau = (f" τ {rec['committed_in_rounds'] / rec['rounds']:.2f}"
               if rec["rounds"] and m.method in ("sd", "dloop") else "")
        same = "" if rec.get("lossless_vs_ar") in (None, True) else " DIFFERS"
        parts.append(f"{m.label} {tps:.1f}{tau}{same}")
      _log(f"[bench {i + 1}/{len(prompts)} {p.category}/{p.set_name}] {len(ids)} prompt tokens,"
           f" {recs[0]['new_tokens']} new | " + " | ".join(parts))

    sweep = []
    if args.sweep and drafters:
      sweep = _sweep(args, prompts, records, drafters, target,
                     base.replace(schedule=schedules[0], costs=costs), common, methods_lib)

    rows = report.summarize(records)
    os.makedirs(args.out, exist_ok=True)
    config = {k: v for k, v in vars(args).items()}
    # Results travel (and go into docs): no directory of this machine in them.
    path, name = recorded_paths.recorded_path, recorded_paths.recorded_name
    config.update(out=path(args.out), data_dir=args.data_dir and path(args.data_dir),
                  target=name(args.target), costs=args.costs and path(args.costs),
                  drafters=",".join(name(d) for d in _names(args.drafters)))
    # The decoding options every method of ours started from, defaults included.
    config.update(gate=base.gate, max_stages=base.max_stages, block_size=base.block_size,
                  draft_backoff=base.draft_backoff, temperature=sampling.temperature,
                  top_p=sampling.top_p, top_k=sampling.top_k)
    config.update(prompts_per_category=per_category,
                  block_sizes={label: base.block_size or d.block_size for label, d in drafters},
                  cost_table=costs.to_json() if costs is not None else None)
    result = dict(config=config, machine=_machine(threads), rows=rows, records=records,
                  sweep=sweep, first_call_compile_seconds=first_compile)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(result, f, indent=1)
    table = report.markdown(rows)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(table + "\n")
    report.plot_speedups(rows, os.path.join(args.out, "speedup.png"))
    wrote_trees = report.plot_trees(rows, os.path.join(args.out, "trees.png"))
    if sweep:
      report.plot_sweep(sweep, os.path.join(args.out, "gate_sweep.png"))
    print(table)
    overall = {(r["method"], r["drafter"]): r for r in rows if r["category"] == report.OVERALL}
    print(f"\nFirst-call compile of our ar: {first_compile['ar']:.1f}s")
    for peer in methods_lib.PEERS:
      if (peer, "") in overall:
        ratio = overall[("ar", "")]["tokens_per_second"] / overall[(peer, "")]["tokens_per_second"]
        engine = "llama.cpp" if peer == llama_cpp_peer.NAME else "transformers"
        print(f"Our ar vs {engine} {peer}: {ratio:.2f}x tokens/s")
    if sampling.greedy and (llama_cpp_peer.NAME, "") in overall:
      print(_agreement(records, llama_cpp_peer.NAME))
    suffixes = [""] + [f"@{w}" for w in args.weights[1:]]
    for label, _ in drafters:
      for suffix in suffixes:
        for mode in ("sd", "dloop"):
          on = overall.get((mode + suffix, label))
          off = overall.get((f"{mode}/all{suffix}", label))
          if on and off:
            print(f"{label}: {mode}{suffix} verifying the prefix that pays"
                  f" {on['tokens_per_second'] / off['tokens_per_second']:.2f}x verifying every"
                  f" draft ({on['verified_fraction']:.0%} of drafts verified,"
                  f" {on['plain_round_fraction']:.0%} plain rounds)")
        sd, dl = overall.get(("sd" + suffix, label)), overall.get(("dloop" + suffix, label))
        if dl:
          tps = dl["tokens_per_second"]
          vs_sd = f", {tps / sd['tokens_per_second']:.2f}x sd{suffix}" if sd else ""
          vs_peers = "".join(f", {tps / overall[(p, '')]['tokens_per_second']:.2f}x {p}"
                             for p in methods_lib.PEERS if (p, "") in overall)
          print(f"{label}: dloop{suffix} {dl['speedup_vs_ar']:.2f}x ar{vs_sd}{vs_peers};"
                f" tau {dl['acceptance_length']:.2f} (dloop)"
                + (f" vs {sd['acceptance_length']:.2f} (sd)" if sd else ""))
    for (method, label), row in overall.items():
      chain = overall.get((method.replace(f"/tree{row['tree_budget']}", ""), label))
      if row["tree_budget"] and chain and chain["acceptance_length"] and row["acceptance_length"]:
        print(f"{label}: {method} tau {row['acceptance_length']:.2f}"
              f" ({row['acceptance_length'] / chain['acceptance_length']:.2f}x the chain's),"
              f" {row['tokens_per_second'] / chain['tokens_per_second']:.2f}x its tokens/s,"
              f" modeled accelerator speedup {_ratio(row['modeled_speedup'])} vs"
              f" {_ratio(chain['modeled_speedup'])}")
    _log(f"[bench] wrote {args.out}/results.json, results.md, speedup.png"
         + (", gate_sweep.png" if sweep else "") + (", trees.png" if wrote_trees else ""))
    if sampling.greedy:
      broken = _not_lossless(records)
      if broken:
        print(f"\nFAILED: {len(broken)} greedy output(s) of exact methods differ from ar's"
              " (beyond the near-tie rule): " + "; ".join(broken[:10]), file=sys.stderr)
        return 3
  except DLoopError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def _not_lossless(records) -> list[str]:
  """Records of exact methods (all but `~inexact` ones and the peers) whose greedy output
  is not ar's (identical, or first differing at a near-tie)."""
  from infer.bench import methods as methods_lib  # pylint: disable=g-import-not-at-top
  return [f"{r['method']}[{r['drafter']}] on {r['prompt_id']}" for r in records
          if "~inexact" not in r["method"] and r["method"] not in methods_lib.PEERS
          and r.get("lossless_vs_ar") is False]


def _peers(args, *, source, pad_token_id, threads: int, common) -> list:
  """The peers --peers / --no-peers ask for; llama.cpp left out, in one line, where it cannot
  run and was not named."""
  from infer.bench import llama_cpp_peer  # pylint: disable=g-import-not-at-top
  from infer.bench import methods as methods_lib  # pylint: disable=g-import-not-at-top
  if args.no_peers:
    return []
  names = args.peers
  if names is None:
    names = list(methods_lib.PEERS)
    why = llama_cpp_peer.missing(source)
    if why:
      _log(f"[bench] {why}")
      names.remove(llama_cpp_peer.NAME)
  peers = []
  if "hf" in names or "hf_pld" in names:
    hf_model = methods_lib.load_hf_reference(source, threads=threads)
    for lookup, name in ((0, "hf"), (args.pld_tokens, "hf_pld")):
      if name in names:
        peers.append(methods_lib.HFPeer(model=hf_model, prompt_lookup=lookup,
                                        pad_token_id=pad_token_id, **common))
  if llama_cpp_peer.NAME in names:
    model = llama_cpp_peer.load(source, threads=threads,
                                context=args.max_prompt_tokens + args.max_new_tokens)
    peers.append(llama_cpp_peer.LlamaCppPeer(model=model, **common))
  return peers


def _agreement(records, method: str) -> str:
  """How a peer's greedy outputs agree with our ar's: identical ones, and where the others
  first leave them."""
  recs = [r for r in records if r["method"] == method and r.get("identical_to_ar") is not None]
  same = sum(bool(r["identical_to_ar"]) for r in recs)
  firsts = sorted((r["first_difference"], r.get("top2_gap")) for r in recs
                  if not r["identical_to_ar"])
  where = ("; the others first differ at new token (our top-2 logit gap there) " + ", ".join(
      f"{i} ({'-' if gap is None else f'{gap:.3f}'})" for i, gap in firsts)) if firsts else ""
  return (f"{method}: {same}/{len(recs)} outputs identical to our ar's{where} (its own"
          " kernels on the file's quantized weights, ours on them dequantized)")


def _sweep(args, prompts, records, drafters, target, base, common, methods_lib) -> list[dict]:
  """DLoop over gate x S_max on the first --sweep-prompts prompts of each category."""
  from dloop_jax.decoding import arguments  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import costs as costs_lib  # pylint: disable=g-import-not-at-top
  from infer.bench import report  # pylint: disable=g-import-not-at-top
  chosen, seen = [], {}
  for p, ids in prompts:
    if seen.get(p.category, 0) < args.sweep_prompts:
      chosen.append((p, ids))
      seen[p.category] = seen.get(p.category, 0) + 1
  keys = {(p.category, p.id) for p, _ in chosen}
  ar = [r for r in records if r["method"] == "ar" and (r["category"], r["prompt_id"]) in keys]
  ar_tokens = {(r["category"], r["prompt_id"]): r["tokens"] for r in ar}
  # Under the gpu profile's table (flat: the accelerator the modeled speedup assumes) the
  # scheduler and gate="auto" decide as they would there, so the modeled figure is theirs.
  tables = {"machine": None, "gpu": costs_lib.default_table("gpu")}
  gates = [(g, name, tables[name]) for name in args.sweep_costs for g in args.sweep_gates]
  points = []
  for label, d in drafters:
    # The gate alone: every round drafts (no back-off), the scheduler and the
    # lookup stage as in the main run (its first --lookups: one program more at most).
    m = methods_lib.Ours(
        decoding=base.replace(mode="dloop", draft_backoff=0, lookup=args.lookups[0],
                              fixed_width=0, allow_inexact=arguments.is_16_bit(target.model)),
        target=target.model, drafter=d, drafter_label=label, **common)
    for s_max in args.sweep_max_stages:
      # `timed_run` repeats a run that compiled (once per S_max: the gate is traced).
      for g, costs_name, table in gates:
        changes = dict(gate=g, max_stages=s_max) | ({"costs": table} if table else {})
        recs = []
        for p, ids in chosen:
          rec = _record(p, m, methods_lib.timed_run(m, ids, **changes), prompt_len=len(ids))
          _check_against_ar(target.model, ids, ar_tokens[p.category, p.id], rec,
                            greedy=m.decoding.sampling.greedy)
          recs.append(rec)
        # The same aggregation as the main table, over these prompts and their ar runs.
        row = next(r for r in report.summarize(ar + recs)
                   if r["category"] == report.OVERALL and r["method"] == m.method_name)
        point = dict(drafter=label, gate=g, max_stages=s_max, prompts=len(recs),
                     costs=costs_name,
                     identical_to_ar=sum(bool(r["identical_to_ar"]) for r in recs),
                     lossless_vs_ar=sum(bool(r["lossless_vs_ar"]) for r in recs),
                     **{k: row[k] for k in ("tokens_per_second", "speedup_vs_ar",
                                            "modeled_speedup", "acceptance_length",
                                            "stages_per_round", "multi_stage_fraction")})
        points.append(point)
        name = f"{g:+.2f}" if g != arguments.AUTO_GATE else "auto"
        _log(f"[sweep {label}] S_max {s_max} g {name} ({costs_name} costs): τ"
             f" {point['acceptance_length']:.2f},"
             f" {point['stages_per_round']:.2f} stages/round,"
             f" speedup {point['speedup_vs_ar']:.2f}×, modeled accelerator"
             f" {point['modeled_speedup']:.2f}×, {point['identical_to_ar']}/{len(recs)}"
             " identical to ar")
  return points


if __name__ == "__main__":
  sys.exit(main())
