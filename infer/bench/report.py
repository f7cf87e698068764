"""Benchmark results: per-prompt records -> rows per (category, method, drafter), table, plots.

A record is one prompt under one method (see `__main__`): new tokens, seconds,
rounds, ..., and `identical_to_ar` / `lossless_vs_ar` (near-tie rule). Rows sum
tokens and seconds over a category's prompts (tokens/s = total tokens / total
seconds) and compare with our `ar` on the same prompts.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterable, Sequence

OVERALL = "overall"

# A method as `methods.OurMethod.method_name` spells it:
# mode[/treeB][/all][~prob][+lookup][/wW][@weights].
_METHOD_NAME = re.compile(r"(?P<mode>[a-z_]+)(?:/tree(?P<budget>\d+))?(?P<all>/all)?"
                          r"(?P<prob>~prob)?(?P<lookup>\+lookup)?(?:/w(?P<width>\d+))?"
                          r"(?:@(?P<weights>\w+))?")


def modeled_tokens_per_step(recs: Sequence[dict]) -> float | None:
  """Tokens per target step on an accelerator, modeled (not measured).

  There a forward of a few to a few dozen tokens costs about one step (it
  streams the weights once), so every target forward costs 1 whatever its
  width, and a drafter forward `draft_cost_ratio` (its decoder layers over
  the target's): tokens / (target forwards + ratio x drafter forwards). Our
  `ar` scores about 1; a method's modeled speedup is its figure over ar's.
  """
  steps = sum(r.get("target_forwards", 0) + r.get("draft_cost_ratio", 0.0)
              * r.get("drafter_forwards", 0) for r in recs)
  return sum(r["new_tokens"] for r in recs) / steps if steps > 0 else None


def _row(category: str, method: str, drafter: str, recs: Sequence[dict],
         ar_tps: float | None, ar_per_step: float | None = None) -> dict:
  tokens = sum(r["new_tokens"] for r in recs)
  seconds = sum(r["seconds"] for r in recs)
  rounds = sum(r["rounds"] for r in recs)
  committed = sum(r["committed_in_rounds"] for r in recs)
  hist = collections.Counter()
  for r in recs:
    for stages, count in enumerate(r.get("stage_histogram") or []):
      hist[stages] += count
  verifications = sum(hist.values())
  tps = tokens / seconds if seconds > 0 else 0.0
  per_step = modeled_tokens_per_step(recs)
  checked = [r for r in recs if r.get("lossless_vs_ar") is not None]
  drafted = sum(r.get("drafted", 0) for r in recs)
  return dict(
      category=category, method=method, drafter=drafter, prompts=len(recs),
      mode=recs[0].get("mode", method), tree_budget=recs[0].get("tree_budget", 0),
      new_tokens=tokens, seconds=seconds, tokens_per_second=tps,
      speedup_vs_ar=(tps / ar_tps) if ar_tps else None,
      modeled_tokens_per_step=per_step,
      modeled_speedup=(per_step / ar_per_step) if per_step and ar_per_step else None,
      acceptance_length=(committed / rounds) if rounds else None,
      stages_per_round=(sum(s * c for s, c in hist.items()) / verifications
                        if verifications else None),
      # DLoop's gate at work: the fraction of rounds that drafted a second stage or more.
      multi_stage_fraction=(sum(c for s, c in hist.items() if s >= 2) / verifications
                            if verifications else None),
      target_forwards=sum(r["target_forwards"] for r in recs) or None,
      # What the scheduler did: drafts verified / drafted, rounds that verified none.
      verified_fraction=(sum(r.get("verified", 0) for r in recs) / drafted) if drafted else None,
      plain_round_fraction=(sum(r.get("plain_rounds", 0) for r in recs) / rounds
                            if drafted and rounds else None),
      drafter_forwards=sum(r["drafter_forwards"] for r in recs) or None,
      compile_seconds=sum(r.get("compile_seconds", 0.0) for r in recs),
      identical_to_ar=(sum(bool(r["identical_to_ar"]) for r in checked) / len(checked)
                       if checked else None),
      lossless_vs_ar=(sum(bool(r["lossless_vs_ar"]) for r in checked) / len(checked)
                      if checked else None))


def summarize(records: Iterable[dict]) -> list[dict]:
  """Rows per (category, method, drafter), then the same over all categories ("overall")."""
  records = list(records)
  groups: dict[tuple, list[dict]] = collections.defaultdict(list)
  for r in records:
    groups[(r["category"], r["method"], r["drafter"])].append(r)
    groups[(OVERALL, r["method"], r["drafter"])].append(r)
  ar_tps, ar_per_step = {}, {}
  for (category, method, _), recs in groups.items():
    if method == "ar":
      s = sum(r["seconds"] for r in recs)
      ar_tps[category] = sum(r["new_tokens"] for r in recs) / s if s > 0 else None
      ar_per_step[category] = modeled_tokens_per_step(recs)
  order = {m: i for i, m in enumerate(("ar", "sd", "sd/all", "dloop", "dloop/all", "hf",
                                        "hf_pld", "llama_cpp"))}

  def rank(method: str) -> tuple:
    # Trees after their chain, then the scheduler's confidence, the weights, the width:
    # ar, ar@bf16, ar/w5@bf16, sd, sd~prob, sd/tree8, sd/tree16, sd/all, sd/all/w5@bf16,
    # sd/tree8/all, ..., dloop, ...
    parts = _METHOD_NAME.fullmatch(method)
    if parts is None:
      return (len(order), 0, False, False, "", 0, method)
    chain = parts["mode"] + (parts["all"] or "")
    return (order.get(chain, len(order)), int(parts["budget"] or 0), bool(parts["prob"]),
            bool(parts["lookup"]), parts["weights"] or "", int(parts["width"] or 0), method)

  keys = sorted(groups, key=lambda k: (k[0] == OVERALL, k[0], rank(k[1]), k[2]))
  return [_row(c, m, d, groups[(c, m, d)], ar_tps.get(c), ar_per_step.get(c))
          for c, m, d in keys]


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
  """x formatted by `spec` and `suffix`; "–" for None and NaN."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  return f"{x:{spec}}{suffix}"


def markdown(rows: Sequence[dict]) -> str:
  """The results table (one line per category, method and drafter)."""
  head = ("| category | method | drafter | prompts | tokens/s | speedup vs ar |"
          " modeled speedup (accelerator) | τ |"
          " stages/round | rounds with 2+ stages | identical to ar | lossless (near-tie rule) | drafts verified |"
          " plain rounds |")
  lines = [head, "|" + "---|" * 14]
  for r in rows:
    lines.append(
        f"| {r['category']} | {r['method']} | {r['drafter'] or '–'} | {r['prompts']} |"
        f" {fmt(r['tokens_per_second'], '.1f')} | {fmt(r['speedup_vs_ar'], '.2f', '×')} |"
        f" {fmt(r.get('modeled_speedup'), '.2f', '×')} |"
        f" {fmt(r['acceptance_length'])} | {fmt(r['stages_per_round'])} |"
        f" {fmt(r.get('multi_stage_fraction'), '.0%')} |"
        f" {fmt(r['identical_to_ar'], '.0%')} | {fmt(r['lossless_vs_ar'], '.0%')} |"
        f" {fmt(r.get('verified_fraction'), '.0%')} |"
        f" {fmt(r.get('plain_round_fraction'), '.0%')} |")
  return "\n".join(lines)


def _label(row: dict) -> str:
  return row["method"] if not row["drafter"] else f"{row['method']}\n{row['drafter']}"


def plot_speedups(rows: Sequence[dict], path: str) -> None:
  """Grouped bars: speedup vs our ar, per category (groups) and method (bars)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  categories = list(dict.fromkeys(r["category"] for r in rows))
  methods = list(dict.fromkeys(_label(r) for r in rows if r["method"] != "ar"))
  by = {(r["category"], _label(r)): r["speedup_vs_ar"] or 0.0 for r in rows}
  width = 0.8 / max(1, len(methods))
  width_in = min(14.0, max(6.0, 0.3 * len(categories) * max(1, len(methods)) + 2))
  fig, ax = plt.subplots(figsize=(width_in, 4.5))
  for i, m in enumerate(methods):
    xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
    bars = ax.bar(xs, [by.get((c, m), 0.0) for c in categories], width, label=m.replace("\n", " "))
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
  ax.axhline(1.0, color="gray", lw=0.8, ls="--")
  ax.set_xticks(range(len(categories)), categories)
  ax.set_ylabel("speedup vs our autoregressive")
  ax.legend(fontsize=7, ncols=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_sweep(points: Sequence[dict], path: str) -> None:
  """tau, speedup and the modeled accelerator speedup against the gate g, one line per
  drafter, S_max and cost table (dotted: the gpu profile's); gate="auto" as a dashed
  horizontal line of its series' color."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  series = collections.defaultdict(list)
  for p in points:
    series[(p["drafter"], p["max_stages"], p.get("costs", "machine"))].append(p)
  numeric = [p for p in points if not isinstance(p["gate"], str)]
  # g = -inf (always draft S_max stages) is drawn one step left of the finite gates.
  finite = sorted({p["gate"] for p in numeric if math.isfinite(p["gate"])}) or [0.0]
  step = (finite[-1] - finite[0]) / max(len(finite) - 1, 1) or 1.0
  minus_inf_at = finite[0] - step

  def x_of(gate: float) -> float:
    return minus_inf_at if gate == -math.inf else gate

  keys = ("acceptance_length", "speedup_vs_ar", "modeled_speedup")
  for (drafter, s_max, costs), pts in sorted(series.items()):
    fixed = sorted((p for p in pts if not isinstance(p["gate"], str)), key=lambda p: p["gate"])
    label = f"{drafter}, S_max={s_max}, {costs} costs"
    color = None
    for ax, key in zip(axes, keys):
      line, = ax.plot([x_of(p["gate"]) for p in fixed], [p[key] or 0.0 for p in fixed],
                      "o-" if costs == "machine" else "s:", label=label, color=color)
      color = line.get_color()
      for p in pts:
        if isinstance(p["gate"], str):
          ax.axhline(p[key] or 0.0, color=color, linestyle="--", linewidth=1,
                     label=f"{label}: auto")
  has_minus_inf = any(p["gate"] == -math.inf for p in numeric)
  names = ("acceptance length τ", "speedup vs autoregressive (this machine)",
           "modeled accelerator speedup")
  for ax, name in zip(axes, names):
    ax.set_xlabel("gate g")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    if has_minus_inf:
      ticks = [minus_inf_at] + finite
      ax.set_xticks(ticks, ["-∞"] + [f"{g:g}" for g in finite])
  axes[1].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_trees(rows: Sequence[dict], path: str) -> bool:
  """τ and tokens/s against the tree budget (0 = the chain), per drafter, mode and schedule.

  Overall rows only; nothing is written (False) unless some row has a tree.
  """
  overall = [r for r in rows if r["category"] == OVERALL and r.get("mode") in ("sd", "dloop")]
  if not any(r.get("tree_budget") for r in overall):
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  series = collections.defaultdict(list)
  for r in overall:
    verify = "all" if r["method"].endswith("/all") else "cost"
    series[(r["drafter"], r["mode"], verify)].append(r)
  fig, (ax_tau, ax_tps) = plt.subplots(1, 2, figsize=(10, 4))
  for (drafter, mode, verify), pts in sorted(series.items()):
    pts = sorted(pts, key=lambda r: r["tree_budget"])
    xs = [r["tree_budget"] for r in pts]
    label = f"{drafter} {mode}" + ("/all" if verify == "all" else "")
    ax_tau.plot(xs, [r["acceptance_length"] or 0.0 for r in pts], "o-", label=label)
    ax_tps.plot(xs, [r["tokens_per_second"] for r in pts], "o-", label=label)
  for ax, name in ((ax_tau, "acceptance length τ"), (ax_tps, "tokens/s (this machine)")):
    ax.set_xlabel("tree budget B (nodes per stage; 0 = chain)")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  ax_tps.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
