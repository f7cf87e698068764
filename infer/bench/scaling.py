"""The data-scaling curve: engine τ against the number of training examples.

Drafters trained with one recipe on nested subsets of one dataset
(`data.max_examples`, scripts/smollm2_drafters.sh) are measured by one
benchmark run; this reads its results.json and writes the table and the plot:

  python -m infer.bench --no-peers --schedules off \\
      --drafters RUNS/block_1000/best,RUNS/block_3000/best,RUNS/block_all/best --out OUT
  python -m infer.bench.scaling --results OUT/results.json \\
      --examples block_1000=1000 --examples block_3000=3000 --examples block_all=10000

τ is fitted per drafter kind and method as `τ = a + b · log10(examples)` (least
squares) and evaluated at `--extrapolate-to` examples: an extrapolation from a
few points, printed as one, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

from infer.bench import report

_CHAIN_METHODS = ("sd/all", "dloop/all", "sd", "dloop")


def fit_log_linear(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
  """(a, b) of the least-squares line τ = a + b · log10(n) through (n, τ) points."""
  if len({n for n, _ in points}) < 2:
    raise ValueError("A fit needs τ at two data sizes or more.")
  xs = [math.log10(n) for n, _ in points]
  ys = [t for _, t in points]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return my - b * mx, b


def curve(rows: Sequence[dict], examples: Mapping[str, int]) -> list[dict]:
  """One point per (drafter, chain method) of the overall rows whose drafter is in `examples`.

  The drafter's kind is its label up to the last "_" (block_1000 -> block).
  """
  points = []
  for r in rows:
    if (r["category"] != report.OVERALL or r["drafter"] not in examples
        or r["method"] not in _CHAIN_METHODS or r.get("acceptance_length") is None):
      continue
    points.append(dict(kind=r["drafter"].rsplit("_", 1)[0], drafter=r["drafter"],
                       examples=examples[r["drafter"]], method=r["method"],
                       tau=r["acceptance_length"],
                       multi_stage_fraction=r.get("multi_stage_fraction"),
                       identical_to_ar=r.get("identical_to_ar"), prompts=r["prompts"]))
  missing = sorted(set(examples) - {p["drafter"] for p in points})
  if missing:
    raise ValueError(f"No overall sd / dloop row for drafter(s) {missing} in the results; the "
                     "labels are the names the benchmark printed (a run's `best` export is "
                     "named by its run directory, e.g. block_1000).")
  return sorted(points, key=lambda p: (p["kind"], p["method"], p["examples"]))


def fits(points: Sequence[dict]) -> dict[tuple[str, str], tuple[float, float]]:
  """(kind, method) -> (a, b) for every series with two data sizes or more."""
  series = collections.defaultdict(list)
  for p in points:
    series[(p["kind"], p["method"])].append((p["examples"], p["tau"]))
  return {k: fit_log_linear(v) for k, v in series.items() if len({n for n, _ in v}) >= 2}


def markdown(points: Sequence[dict], *, extrapolate_to: int) -> str:
  """The measured table, then the fitted lines and their extrapolation."""
  lines = ["| drafter | examples | method | τ | rounds with 2+ stages | identical to ar |",
           "|---|---|---|---|---|---|"]
  for p in points:
    lines.append(f"| {p['drafter']} | {p['examples']:,} | {p['method']} | {p['tau']:.3f} |"
                 f" {report.fmt(p['multi_stage_fraction'], '.0%')} |"
                 f" {report.fmt(p['identical_to_ar'], '.0%')} |")
  fitted = fits(points)
  if fitted:
    lines += ["", f"| kind | method | fit τ = a + b·log10(examples) | extrapolated τ at "
                  f"{extrapolate_to:,} examples (not measured) |", "|---|---|---|---|"]
    for (kind, method), (a, b) in sorted(fitted.items()):
      lines.append(f"| {kind} | {method} | {a:.3f} + {b:.3f}·log10(n) |"
                   f" {a + b * math.log10(extrapolate_to):.2f} |")
  return "\n".join(lines)


def plot(points: Sequence[dict], path: str, *, extrapolate_to: int) -> None:
  """τ against examples (log axis), measured points joined, fits dashed out to `extrapolate_to`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  series = collections.defaultdict(list)
  for p in points:
    series[(p["kind"], p["method"])].append(p)
  fitted = fits(points)
  for key, pts in sorted(series.items()):
    line, = ax.plot([p["examples"] for p in pts], [p["tau"] for p in pts], "o-",
                    label=f"{key[0]} {key[1]}")
    if key in fitted:
      a, b = fitted[key]
      lo = min(p["examples"] for p in pts)
      ax.plot([lo, extrapolate_to], [a + b * math.log10(n) for n in (lo, extrapolate_to)], "--",
              color=line.get_color(), alpha=0.6)
  ax.set_xscale("log")
  ax.set_xlabel("training examples (dashed: log-linear fit, extrapolated)")
  ax.set_ylabel("engine acceptance length τ")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _examples_arg(text: str) -> tuple[str, int]:
  label, sep, n = text.rpartition("=")
  if not sep or not label or not n.isdigit() or int(n) <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: expected DRAFTER_LABEL=EXAMPLES, e.g. "
                                     "block_1000=1000")
  return label, int(n)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m infer.bench.scaling",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--results", required=True, help="a benchmark's results.json")
  parser.add_argument("--examples", type=_examples_arg, action="append", required=True,
                      metavar="LABEL=N", help="a drafter's label and its training examples")
  parser.add_argument("--extrapolate-to", type=int, default=100_000)
  parser.add_argument("--out", default=None,
                      help="output directory (default: the results' directory)")
  args = parser.parse_args(argv)
  try:
    with open(args.results) as f:
      rows = json.load(f)["rows"]
  except (OSError, json.JSONDecodeError, KeyError) as e:
    print(f"error: cannot read benchmark rows from {args.results}: {e}", file=sys.stderr)
    return 2
  try:
    points = curve(rows, dict(args.examples))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = args.out or os.path.dirname(os.path.abspath(args.results))
  os.makedirs(out, exist_ok=True)
  table = markdown(points, extrapolate_to=args.extrapolate_to)
  with open(os.path.join(out, "scaling.md"), "w") as f:
    f.write(table + "\n")
  plot(points, os.path.join(out, "scaling.png"), extrapolate_to=args.extrapolate_to)
  print(table)
  print(f"[scaling] wrote {out}/scaling.md, scaling.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
