"""The check's files (results.json, summary.md) and its one-line verdict."""

from __future__ import annotations

import json
import os

from infer.bench.report import fmt

FORMAT = "dloop_jax.device_check/1"
# Correctness checks: a failure makes the verdict FAIL and the exit status 1.
CORRECTNESS = {"fixed_bf16": "greedy fixed-width bf16 (exact)",
               "free_f32": "greedy free-width f32 (near-tie rule)",
               "tree_f32": "greedy draft tree f32 (near-tie rule)",
               "sampling": "sampling smoke test (temperature 1)"}
# Measurements: an error in one makes the verdict FAIL too; a skipped prefill length does not.
MEASUREMENTS = {"speed": "speed in the decode loop", "prefill": "prefill tokens/s"}


def check_status(result: dict, name: str) -> str | None:
  """PASS / FAIL of a correctness check, OK / ERROR of a measurement; None: not run."""
  if name == "sampling":
    s = result.get("sampling")
    return None if s is None else "PASS" if s.get("ok") else "FAIL"
  if name in CORRECTNESS:
    by_batch = result.get("correctness", {}).get(name)
    if not by_batch:
      return None
    return "PASS" if all(r.get("ok") for r in by_batch.values()) else "FAIL"
  value = result.get(name)
  if not value:
    return None  # not run, or not yet
  entries = value.values() if isinstance(value, dict) else value
  return "ERROR" if any("error" in e for e in entries) else "OK"


def verdict(result: dict) -> tuple[str, bool]:
  """(the one-line verdict, whether everything run passed)."""
  parts, ok = [], True
  for name in list(CORRECTNESS) + list(MEASUREMENTS):
    status = check_status(result, name)
    if status is None:
      continue
    ok = ok and status in ("PASS", "OK")
    parts.append(f"{name} {status}")
  skipped = [p["length"] for p in result.get("prefill", []) if "skipped" in p]
  note = f" (prefill skipped at {', '.join(map(str, skipped))} tokens)" if skipped else ""
  dev = result.get("device", {})
  where = (f"{result.get('preset', '?')} on {dev.get('device_kind', '?')}"
           f" ({dev.get('backend', '?')})")
  return f"{'PASS' if ok else 'FAIL'} device_check {where}: {', '.join(parts)}{note}", ok


def _mismatch_lines(entry: dict) -> list[str]:
  lines = []
  for name, run in entry.get("runs", {}).items():
    for p in run.get("stats_problems", []):
      lines.append(f"  - {name}: statistics: {p}")
    for m in (run.get("comparison") or {}).get("mismatches", []):
      if m.get("row") is None:
        lines.append(f"  - {name}: {m.get('problem')}")
        continue
      lines.append(f"  - {name}, row {m['row']}: first difference at new token"
                   f" {m['first_difference']}, target's top-2 logit gap there"
                   f" {fmt(m['top2_gap'], '.3g')} (near-tie below {fmt(m['tolerance'], '.3g')}):"
                   f" expected {m['expected']} got {m['got']}")
  if entry.get("error"):
    lines.append(f"  - error: {entry['error']}")
  return lines


def markdown(result: dict) -> str:
  """summary.md: the verdict, then correctness, speed and prefill as tables."""
  line, _ = verdict(result)
  dev = result.get("device", {})
  t = result.get("target", {})
  shape = result.get("shape", {})
  lines = [
      "# Device check", "", f"**{line}**", "",
      f"{dev.get('device_kind', '?')} ({dev.get('backend', '?')}, {dev.get('count', '?')}"
      f" device(s)), jax {dev.get('jax', '?')}; preset `{result.get('preset')}`:"
      f" {t.get('label', '?')}, random weights, {t.get('params', 0) / 1e6:,.1f}M parameters;"
      f" drafter {result.get('drafter', '?')} (random weights); gamma"
      f" {shape.get('block_size')}, S_max {shape.get('max_stages')}, fixed width"
      f" {shape.get('width')}, tree budget {shape.get('tree_budget')}; f32 matmul precision"
      f" `{result.get('f32_matmul_precision')}`; {result.get('elapsed_s', 0):.0f} s in all.", "",
      "## Correctness (greedy: every mode against ar)", "",
      "| check | batch | runs | identical rows | accepted drafts | result |",
      "|---|---|---|---|---|---|"]
  details = []
  for name, label in CORRECTNESS.items():
    if name == "sampling":
      continue
    for batch, entry in result.get("correctness", {}).get(name, {}).items():
      runs = entry.get("runs", {})
      compared = [r for r in runs.values() if "comparison" in r]
      identical = ", ".join(f"{n} {r['comparison']['identical_rows']}/{r['comparison']['rows']}"
                            for n, r in runs.items() if "comparison" in r) or "–"
      accepted = sum(r.get("accepted", 0) for r in compared)
      lines.append(f"| {label} | {batch} | {', '.join(runs) or '–'} | {identical} |"
                   f" {accepted} | {'PASS' if entry.get('ok') else 'FAIL'} |")
      if not entry.get("ok"):
        details += [f"- {label}, batch {batch}:"] + _mismatch_lines(entry)
  s = result.get("sampling")
  if s is not None:
    lines += ["", "Sampling smoke test (dloop, temperature 1, fixed width): "
              + (f"PASS, batch {s.get('batch_size')}, {s.get('new_tokens')} tokens,"
                 f" {s.get('distinct_tokens')} distinct ids, {s.get('accepted')} drafts accepted."
                 if s.get("ok") else f"FAIL: {'; '.join(s.get('problems', []))}"
                 f" {s.get('error', '')}".strip())]
  if details:
    lines += ["", "### What failed", ""] + details
  speed = result.get("speed")
  if speed:
    lines += [
        "", "## Speed inside the decode loop (bf16 weights and compute)", "",
        "ms per loop iteration from two runs of one compiled program (prefill cancelled),"
        " against the isolated forward (`decoding.costs.calibrate`, half-full 512-slot cache)"
        " and, for dloop, the modeled round T(W) + S·stage + commit (`python -m"
        " infer.profile`'s model). Random drafts are nearly all rejected: a dloop round commits"
        " about one token.",
        "", "| batch | loop | ms / iteration | isolated ms | × isolated | tokens/s | note |",
        "|---|---|---|---|---|---|---|"]
    for batch, entry in speed.items():
      if "error" in entry:
        lines.append(f"| {batch} | – | – | – | – | – | error: {entry['error']} |")
        continue
      for name, label in (("ar", "ar (width 1)"), ("ar_fixed", f"ar at width {shape.get('width')}"),
                          ("dloop", f"dloop round ({shape.get('max_stages')} stages, width"
                                    f" {shape.get('width')})")):
        e = entry.get(name)
        if not e:
          continue
        note = "" if e.get("shared_program") else "short run compiled its own program"
        lines.append(f"| {batch} | {label} | {fmt(e.get('ms_per_iteration'), '.3f')} |"
                     f" {fmt(e.get('isolated_ms'), '.3f')} | {fmt(e.get('ratio'), '.2f', '×')} |"
                     f" {fmt(e.get('tokens_per_s'), ',.0f')} | {note} |")
    lines += ["", "Isolated costs per batch (ms): " + "; ".join(
        f"batch {b}: T(1) {fmt(e.get('cost_ms', {}).get('1'), '.3f')}, T({shape.get('width')})"
        f" {fmt(e.get('cost_ms', {}).get(str(shape.get('width'))), '.3f')}, stage"
        f" {fmt(e.get('drafter', {}).get('stage_ms'), '.3f')}, commit"
        f" {fmt(e.get('drafter', {}).get('commit_ms'), '.3f')}"
        for b, e in speed.items() if "error" not in e)]
  prefill = result.get("prefill")
  if prefill is not None:
    lines += ["", "## Prefill (bf16, batch 1, one prompt)", "",
              "| tokens | tokens/s | ms | compile s |", "|---|---|---|---|"]
    for p in prefill:
      if "skipped" in p or "error" in p:
        lines.append(f"| {p['length']} | {'skipped' if 'skipped' in p else 'error'}:"
                     f" {p.get('skipped') or p.get('error')} | – | – |")
      else:
        lines.append(f"| {p['length']} | {p['tokens_per_s']:,.0f} | {1e3 * p['seconds']:.1f} |"
                     f" {p['compile_seconds']:.1f} |")
  return "\n".join(lines) + "\n"


def write(out_dir: str, result: dict) -> dict[str, str]:
  """Writes results.json (with the verdict) and summary.md; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = dict(json=os.path.join(out_dir, "results.json"),
               markdown=os.path.join(out_dir, "summary.md"))
  line, ok = verdict(result)
  with open(paths["json"], "w") as f:
    json.dump(dict(result, format=FORMAT, verdict=dict(line=line, ok=ok)), f, indent=1,
              default=str)
  with open(paths["markdown"], "w") as f:
    f.write(markdown(result))
  return paths
