"""`python -m infer.profile`: what DLoop costs on this device, at real model shapes.

    python -m infer.profile                          # Qwen3-8B shapes, bf16 (minutes on a GPU / TPU)
    python -m infer.profile --preset qwen3-4b --out prof_4b
    python -m infer.profile --preset qwen3-8b --set num_layers=12   # a cut-down 8B
    python -m infer.profile --preset tiny            # seconds, on a CPU

Builds a random-weight target (and one random-weight drafter per kind) at the
preset's shapes on the first JAX device, then measures

  1. the target forward's cost per width (`decoding.costs.calibrate`): chain
     widths 1..65 and the widths 1 + S * B of draft trees of the given budgets;
  2. one drafting stage of gamma tokens and one commit, per drafter kind;
  3. a whole `generate(mode="dloop")`: rounds per second;

and writes to --out:

  costs.json    the per-width table, in the format `python -m infer --costs`,
                `python -m infer.bench --costs`, `generate(costs=...)` and
                $DLOOP_COSTS read;
  profile.json  everything measured, and the modeled speedups;
  profile.md    the same as tables, the modeled one labelled as such.
"""

from __future__ import annotations

import argparse
import sys
import time

# Per preset: gamma, chain widths, tree budgets, new tokens, prompt length.
_DEFAULTS = {
    "qwen3-4b": dict(block_size=16, widths="1,2,3,4,5,9,13,17,25,33,49,65", tree_budgets="16,32",
                     max_new_tokens=64, prompt_length=128),
    "qwen3-8b": dict(block_size=16, widths="1,2,3,4,5,9,13,17,25,33,49,65", tree_budgets="16,32",
                     max_new_tokens=64, prompt_length=128),
    "tiny": dict(block_size=4, widths="1,2,3,5,9,13", tree_budgets="4", max_new_tokens=8,
                 prompt_length=8),
}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m infer.profile", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="qwen3-8b", help=f"target shape: {', '.join(_DEFAULTS)}")
  p.add_argument("--set", dest="overrides", default="",
                 help="change preset fields: field=value,... (e.g. num_layers=12)")
  p.add_argument("--dtype", default=None,
                 help="activations and KV cache: bfloat16 / float32 (default: the preset's)")
  p.add_argument("--weights", default=None,
                 help="weight matrices: bf16 / f32 (default: the activation dtype)")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--block-size", type=int, default=None, help="gamma: drafts per stage")
  p.add_argument("--max-stages", type=int, default=None,
                 help="S_max of the generation and model (default: DecodingConfig's, through"
                      " the profile)")
  p.add_argument("--widths", default=None, help="target forward widths to measure (1..65)")
  p.add_argument("--tree-budgets", default=None,
                 help="draft-tree budgets B: also measures widths 1 + S * B, S <= --max-stages"
                      " ('' for none)")
  p.add_argument("--drafters", default="eagle3,block,dspark,domino",
                 help="drafter kinds whose stage is timed")
  p.add_argument("--generate-drafter", default="block",
                 help="drafter of the timed generation ('none' skips it)")
  p.add_argument("--max-new-tokens", type=int, default=None)
  p.add_argument("--prompt-length", type=int, default=None)
  p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
  p.add_argument("--tau", default="paper",
                 help="tau of the modeled table: 'paper' (published values) and/or numbers")
  p.add_argument("--out", default="profile_out", help="output directory")
  return p.parse_args(argv)


def _ints(text: str, what: str) -> list[int]:
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = [0]
  if any(v < 1 for v in values):
    raise ConfigError(f"{what} takes integers >= 1 separated by commas, got {text!r}.")
  return values


def run(args, log) -> dict:
  """The profile; returns the written paths. Raises DLoopError on bad input."""
  import jax  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import costs as costs_lib  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import tree_round  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import KINDS  # pylint: disable=g-import-not-at-top
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from infer.profile import measure, modeled, presets, report  # pylint: disable=g-import-not-at-top

  config, default_dtype = presets.preset_config(args.preset, args.overrides)
  defaults = _DEFAULTS.get(args.preset, _DEFAULTS["qwen3-8b"])
  dtype = presets.parse_dtype(args.dtype or default_dtype)
  weights = presets.resolve_weights(args.weights, dtype)
  gamma = args.block_size or defaults["block_size"]
  if args.max_stages is None:
    from dloop_jax import profiles  # pylint: disable=g-import-not-at-top
    args.max_stages = profiles.DEFAULT_MAX_STAGES
  new_tokens = args.max_new_tokens or defaults["max_new_tokens"]
  prompt_length = args.prompt_length or defaults["prompt_length"]
  for name, value in (("--batch-size", args.batch_size), ("--block-size", gamma),
                      ("--max-stages", args.max_stages), ("--max-new-tokens", new_tokens),
                      ("--prompt-length", prompt_length), ("--repeats", args.repeats)):
    if value < 1:
      raise ConfigError(f"{name} must be >= 1, got {value}.")
  kinds = [k.strip() for k in args.drafters.split(",") if k.strip()]
  unknown = [k for k in kinds + [args.generate_drafter] if k not in KINDS and k != "none"]
  if unknown:
    raise ConfigError(f"Unknown drafter kinds {unknown}; known: {', '.join(KINDS)}.")
  chain = _ints(args.widths if args.widths is not None else defaults["widths"], "--widths")
  budgets = _ints(args.tree_budgets if args.tree_budgets is not None
                  else defaults["tree_budgets"], "--tree-budgets")
  # One stage (sd) to S_max stages of DLoop, each continuing stage with its best path.
  trees = sorted({1 + n for b in budgets
                  for n in tree_round.max_nodes(budget=b, block_size=gamma,
                                                max_stages=args.max_stages)})
  needed = 1 + args.max_stages * gamma  # the generation's verification width
  widths = sorted(set(chain) | set(trees) | {1, needed})
  capacity = min(costs_lib.CALIBRATION_CAPACITY, config.max_position_embeddings)
  if prompt_length + new_tokens + needed > config.max_position_embeddings:
    raise ConfigError(f"--prompt-length + --max-new-tokens + {needed} verified tokens exceed"
                      f" the context window ({config.max_position_embeddings}); shorten them.")
  if max(widths) > capacity // 2:
    raise ConfigError(f"Widths up to {max(widths)} do not fit the half-full calibration cache"
                      f" of {capacity} slots; measure narrower widths.")
  taus = modeled.parse_taus(args.tau, kinds)

  device = jax.devices()[0]
  label = args.preset + (f" with {args.overrides}" if args.overrides else "")
  gen_capacity = prompt_length + new_tokens + needed
  need = presets.check_fits(config, dtype=dtype, weights=weights, batch_size=args.batch_size,
                            capacity=max(capacity, gen_capacity),
                            available=presets.device_memory_bytes(), preset=label)
  log(f"{label}: {config.num_params() / 1e6:,.1f}M parameters, {jax.numpy.dtype(dtype).name}"
      f" activations, {jax.numpy.dtype(weights).name} weights, about"
      f" {need['total'] / 2 ** 30:.1f} GiB, on {device.device_kind}"
      f" ({jax.default_backend()}, {jax.device_count()} device(s))")
  if jax.default_backend() == "cpu" and config.num_params() > 1e9:
    log("note: this is a CPU; a billion-parameter profile takes long here (use --preset tiny,"
        " or run it on a GPU / TPU)")

  t0 = time.perf_counter()
  target = presets.random_target(config, dtype=dtype, weights=weights)
  jax.block_until_ready(target.embed[...])
  log(f"built the random-weight target in {time.perf_counter() - t0:.1f} s")

  t0 = time.perf_counter()
  log(f"target forward, widths {widths} (batch {args.batch_size}, compiling each)...")
  table = costs_lib.calibrate(target, batch_size=args.batch_size, widths=widths,
                              repeats=args.repeats)
  log(f"  done in {time.perf_counter() - t0:.1f} s:\n{table.format()}")

  drafters, costs_by_kind = {}, {}
  for kind in dict.fromkeys(kinds + ([args.generate_drafter] if args.generate_drafter != "none"
                                     else [])):
    t0 = time.perf_counter()
    drafters[kind] = measure.random_drafter(kind, target=target, block_size=gamma)
    if kind in kinds:
      costs_by_kind[kind] = measure.drafter_costs(
          drafters[kind], target=target, block_size=gamma, batch_size=args.batch_size,
          capacity=capacity, repeats=args.repeats)
      d = costs_by_kind[kind]
      log(f"drafter {kind}: stage of {gamma} {d['stage_ms']:.3f} ms, commit"
          f" {d['commit_ms']:.3f} ms ({time.perf_counter() - t0:.1f} s)")

  generation = None
  if args.generate_drafter != "none":
    t0 = time.perf_counter()
    log(f"dloop generation ({args.generate_drafter}, {args.max_stages} stages of {gamma},"
        f" {new_tokens} new tokens; compiling)...")
    generation = measure.generation_rate(
        target, drafters[args.generate_drafter], block_size=gamma, max_stages=args.max_stages,
        batch_size=args.batch_size, prompt_length=prompt_length, max_new_tokens=new_tokens,
        costs=table)
    generation["drafter"] = args.generate_drafter
    if args.generate_drafter in costs_by_kind:
      generation["modeled_ms_per_round"] = modeled.round_ms(
          table, costs_by_kind[args.generate_drafter], block_size=gamma,
          stages=args.max_stages)
    log(f"  {generation['rounds_per_s']:.2f} rounds/s ({generation['ms_per_round']:.3f} ms per"
        f" round, {time.perf_counter() - t0:.1f} s with compiling)")

  result = dict(
      target=dict(preset=args.preset, overrides=args.overrides, label=label,
                  shape=presets.summary(config),
                  dtype=jax.numpy.dtype(dtype).name, weights=jax.numpy.dtype(weights).name),
      device=dict(backend=jax.default_backend(), device_kind=device.device_kind,
                  count=jax.device_count(), jax=jax.__version__),
      batch_size=args.batch_size, block_size=gamma, max_stages=args.max_stages,
      chain_widths=chain, tree_budgets=budgets, tree_widths=trees, repeats=args.repeats,
      drafters=costs_by_kind, generation=generation,
      modeled=modeled.speedups(table, costs_by_kind, block_size=gamma,
                               max_stages=args.max_stages, entries=taus))
  paths = report.write(args.out, result, table)
  log(f"wrote {paths['costs']} (python -m infer --costs {paths['costs']}), {paths['json']},"
      f" {paths['markdown']}")
  return paths


def main(argv=None) -> int:
  args = _parse(argv)
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()

  def log(message: str) -> None:
    print(f"[profile {time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr,
          flush=True)

  try:
    run(args, log)
  except DLoopError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Exception as e:  # pylint: disable=broad-except
    from infer.profile import presets  # pylint: disable=g-import-not-at-top
    if not presets.is_out_of_memory(e):
      raise
    print(f"error: the device ran out of memory ({str(e).splitlines()[0][:200]}). Profile"
          " smaller shapes: another --preset, --set num_layers=N, --weights bf16 or a smaller"
          " --batch-size.", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  # Here, not in main(): callers in the same process (the tests) keep their own cache settings.
  import infer  # pylint: disable=g-import-not-at-top
  infer.enable_compilation_cache()  # a second run skips most compiling
  sys.exit(main())
