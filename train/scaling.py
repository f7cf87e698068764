"""Data-scaling curve of drafter runs: engine τ against training examples, fitted and plotted.

    python -m train.scaling --runs runs/block_1000,runs/block_3000,runs/block_all \\
        --out scaling.png --extrapolate 100000 --target-tau 2.0
    python -m train.evaluate --drafters runs/block_1000/best,... --json held_out.json
    python -m train.scaling --runs ... --held-out held_out.json --out scaling.png --json curve.json
    python -m train.scaling --curves curve.json --runs runs/block_30000 --held-out ...

Each run is a `python -m train` workdir of one drafter kind and recipe on a
different number of training examples (`data.max_examples`, nested subsets:
`scripts/smollm2_drafters.sh` with SIZES). For each it reads the engine τ the
trainer measured during training (`metrics.jsonl`, `engine_tau_sd`, every draft
verified) and the examples from its checkpoint's config (or --examples). Each
run's point is its best τ, or with --held-out the τ that `python -m train.evaluate
--json` measured on more prompts for the run's best step (row `drafter` = the
workdir or WORKDIR/best). A run whose τ was still rising at its last evaluation,
or that stopped before its steps and its patience ran out, is marked as such:
its point is a lower bound. `--json` archives every run's curve and point;
`--curves` reads such archives back, so a curve outlives the runs' workdirs and
grows by new runs.

It prints a table of the runs and one of their τ at every evaluated step (data sizes
compared at equal training), fits logit(α) linear in log10(examples) (α: the per-draft
acceptance that gives τ = 1 + α + ... + α^γ, `dloop_jax.training.scaling_curve`),
prints the fit's τ at --extrapolate examples and the examples at which it reaches
--target-tau (extrapolations, not measurements), and with --out writes the plot:
τ over training steps per run, and τ against examples with the fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m train.scaling", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--runs", default="", help="comma-separated `python -m train` workdirs")
  p.add_argument("--curves", default="",
                 help="comma-separated JSON files an earlier `--json` wrote: their runs join the"
                      " curve with the points recorded there (runs whose workdirs are gone)")
  p.add_argument("--examples", default="",
                 help="comma-separated training examples of each run (default: each run's"
                      " data.max_examples, or its dataset's size)")
  p.add_argument("--held-out", default="",
                 help="JSON of `python -m train.evaluate --json` over the runs' best steps: use"
                      " its τ as each run's point")
  p.add_argument("--extrapolate", type=int, default=100_000,
                 help="print (and plot) the fit's τ at this many examples")
  p.add_argument("--target-tau", type=float, default=2.0,
                 help="print the examples at which the fit reaches this τ")
  p.add_argument("--out", default="", help="write the plot (PNG) here")
  p.add_argument("--json", default="", help="write the curves, points and fit here")
  args = p.parse_args(argv)
  args.runs = [r for r in args.runs.split(",") if r]
  args.curves = [r for r in args.curves.split(",") if r]
  if not args.runs and not args.curves:
    p.error("name the runs: --runs WORKDIR,... and / or --curves FILE.json,...")
  if args.held_out and not args.runs:
    p.error("--held-out gives the points of --runs; archived curves keep their own")
  if args.examples:
    try:
      args.examples = [int(x) for x in args.examples.split(",")]
    except ValueError:
      p.error(f"--examples must be comma-separated integers, got {args.examples!r}")
    if len(args.examples) != len(args.runs) or min(args.examples) < 1:
      p.error(f"--examples needs one positive count per run ({len(args.runs)}),"
              f" got {args.examples}")
  else:
    args.examples = [None] * len(args.runs)
  if args.extrapolate < 1:
    p.error("--extrapolate must be >= 1")
  return args


def _held_out_taus(path: str, workdirs: list[str]) -> dict[str, float]:
  """workdir -> sd τ of `train.evaluate --json` rows naming the workdir or its best step."""
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    rows = json.load(f).get("rows", [])
  found = {}
  for workdir in workdirs:
    names = {os.path.normpath(workdir), os.path.normpath(os.path.join(workdir, "best"))}
    match = [r for r in rows if os.path.normpath(r.get("drafter", "")) in names
             and not r.get("heads_off") and "engine_tau_sd" in r]
    if not match:
      raise ConfigError(f"{path} has no sd row for {workdir} (or {workdir}/best): evaluate it"
                        " with python -m train.evaluate --drafters ... --json FILE.")
    found[workdir] = float(match[0]["engine_tau_sd"])
  return found


HELD_OUT = "held-out τ of the best step"
BEST = "best engine τ"


def _archived(paths: list[str]) -> list[tuple]:
  """(curve, point τ, point source) of every run in the `--json` files at `paths`."""
  from dloop_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import scaling_curve as sc  # pylint: disable=g-import-not-at-top
  found = []
  for path in paths:
    try:
      with open(path) as f:
        records = json.load(f)["runs"]
      for r in records:
        found.append((sc.RunCurve.from_json(r), float(r["point"]), r["point_source"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
      raise ConfigError(f"{path} is not a curve file that `python -m train.scaling --json`"
                        f" wrote ({type(e).__name__}: {e}).") from None
  return found


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  from dloop_jax.errors import DLoopError  # pylint: disable=g-import-not-at-top
  from dloop_jax.recorded_paths import recorded_path  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import scaling_curve as sc  # pylint: disable=g-import-not-at-top

  try:
    curves = [sc.read_run(w, examples=n) for w, n in zip(args.runs, args.examples)]
    held_out = _held_out_taus(args.held_out, args.runs) if args.held_out else {}
    source = HELD_OUT if args.held_out else BEST
    archived = _archived(args.curves)
    sources = {s for _, _, s in archived} | ({source} if curves else set())
    if len(sources) > 1:
      raise DLoopError(f"The runs' points mix {sorted(sources)}: give the runs --held-out"
                       " exactly when the archived curves hold held-out points.")
    source = sources.pop()
    points = [(c.examples, held_out.get(c.workdir, c.best_tau)) for c in curves]
    curves += [curve for curve, _, _ in archived]
    points += [(curve.examples, tau) for curve, tau, _ in archived]
    gammas = {c.gamma for c in curves}
    if len(gammas) != 1:
      raise DLoopError(f"The runs' drafters draft different block sizes {sorted(gammas)}; a"
                       " scaling curve compares one drafter kind and recipe.")
    scaling = sc.fit(points, gamma=gammas.pop())
    print(sc.table(curves, [tau for _, tau in points] if source == HELD_OUT else None))
    print("\nengine τ at each evaluated step:\n" + sc.steps_table(curves) + "\n")
    for c in curves:
      if not c.converged:
        print(f"note: {c.workdir}: τ was still rising at its last evaluation (step"
              f" {c.steps[-1]:,}): its point is a lower bound.")
      elif not c.finished:
        print(f"note: {c.workdir}: the run stopped at step {c.last_step:,} of"
              f" {c.num_steps:,}, before its patience ran out: its point is a lower bound.")
    at = float(scaling.predict(args.extrapolate))
    need = scaling.examples_for_tau(args.target_tau)
    print(f"fit over {len(points)} points: logit(α) = {scaling.intercept:.3f}"
          f" + {scaling.slope:.3f} · log10(examples)  (γ = {scaling.gamma})")
    print(f"extrapolation, not a measurement: τ {at:.3f} at {args.extrapolate:,} examples;"
          + (f" τ {args.target_tau} at about {need:,.0f} examples" if math.isfinite(need)
             else f" the fit does not rise, so it never reaches τ {args.target_tau}"))
    if args.out:
      sc.plot(curves, points, scaling, extrapolate_to=args.extrapolate, out=args.out,
              point_label=source)
      print(f"wrote {args.out}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(
            runs=[dict(c.to_json(), workdir=recorded_path(c.workdir), best_step=c.best_step,
                       converged=c.converged, finished=c.finished, point=tau,
                       point_source=source)
                  for c, (_, tau) in zip(curves, points)],
            points=points, fit=dict(intercept=scaling.intercept, slope=scaling.slope,
                                    gamma=scaling.gamma),
            extrapolation={str(args.extrapolate): at},
            examples_for_tau={str(args.target_tau): need if math.isfinite(need) else None}),
            f, indent=1)
  except (DLoopError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
