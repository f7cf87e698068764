"""The profile's files: costs.json (the scheduler's table), profile.json and profile.md."""

from __future__ import annotations

import json
import os

from dloop_jax.decoding import costs as costs_lib
from infer.bench.report import fmt


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def markdown(result: dict, table: costs_lib.CostTable) -> str:
  """The human-readable report."""
  t = result["target"]
  dev = result["device"]
  lines = [
      f"# Accelerator profile: {t['label']} on {dev['device_kind']} ({dev['backend']},"
      f" {dev['count']} device(s))",
      "",
      f"Random weights at the shapes of {t['label']}: {t['shape']['num_layers']} layers,"
      f" D {t['shape']['hidden_size']}, vocab {t['shape']['vocab_size']},"
      f" {_count(t['shape']['params'])} parameters; activations {t['dtype']}, weight"
      f" matrices {t['weights']}; batch {result['batch_size']}; jax {dev['jax']}.",
      "",
      "## Target forward cost per width (measured)",
      "",
      "The per-width table the scheduler reads (`costs.json`; `python -m infer --costs"
      " costs.json`). Each forward reads a half-full cache of"
      f" {table.key.get('capacity', '?') if table.key else '?'} slots and verifies `width` tokens"
      " per row.",
      "",
      "| width | ms | × width 1 | note |",
      "|---|---|---|---|",
  ]
  one = table.costs[1]
  tree_widths = set(result["tree_widths"])
  for w, c in table.costs.items():
    note = "tree" if w in tree_widths and w not in result["chain_widths"] else ""
    lines.append(f"| {w} | {c:.3f} | {c / one:.2f} | {note} |")
  lines += ["", f"## Drafting, γ = {result['block_size']} (measured)", "",
            "| drafter | own params | stage ms | commit ms | stage × target step |",
            "|---|---|---|---|---|"]
  for kind, d in result["drafters"].items():
    lines.append(f"| {kind} | {_count(d['params'])} | {d['stage_ms']:.3f} |"
                 f" {d['commit_ms']:.3f} | {d['stage_ms'] / one:.2f} |")
  g = result.get("generation")
  if g:
    lines += [
        "", "## Whole DLoop generation (measured)", "",
        f"`generate(mode=\"dloop\")` with the {g['drafter']} drafter, every round drafting"
        f" {g['max_stages']} stages of {g['block_size']} and verifying width {g['width']}"
        f" (random weights: drafts rejected, one token per round); batch {g['batch_size']},"
        f" prompt {g['prompt_length']}, {g['max_new_tokens']} new tokens, prefill included.", "",
        "| rounds | rounds/s | ms / round | modeled ms / round | compile s |",
        "|---|---|---|---|---|",
        f"| {g['rounds']} | {g['rounds_per_s']:.2f} | {g['ms_per_round']:.3f} |"
        f" {fmt(g.get('modeled_ms_per_round'), '.3f')} | {g['compile_seconds']:.1f} |"]
  m = result["modeled"]
  heads = " | ".join(f"S = {s}" for s in m["stages"])
  lines += [
      "", "## Modeled speedup (not measured)", "",
      "speedup = τ · T(1) / (T(1 + S·γ) + S · stage + commit): a method committing τ tokens per"
      " round of S stages of γ drafts, against autoregressive decoding at T(1) per token, from"
      " the measured costs above. τ is an input (the papers' values are at their own block"
      " sizes and settings). Prefill, scheduling and engine overhead are left out; – : width"
      " not measured, or τ above 1 + S·γ.", "",
      f"| drafter | τ | source | {heads} |", "|---|---|---|" + "---|" * len(m["stages"])]
  for row in m["rows"]:
    cells = " | ".join(fmt(x, ".2f", "×") for x in row["speedup"])
    lines.append(f"| {row['kind']} | {row['tau']:.2f} | {row['source']} | {cells} |")
  lines += ["", "Break-even τ (speedup 1.0×):", "", f"| drafter | {heads} |",
            "|---|" + "---|" * len(m["stages"])]
  for kind, taus in m["break_even"].items():
    lines.append(f"| {kind} | " + " | ".join(fmt(x) for x in taus) + " |")
  return "\n".join(lines) + "\n"


def write(out_dir: str, result: dict, table: costs_lib.CostTable) -> dict[str, str]:
  """Writes the three files; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = dict(costs=os.path.join(out_dir, "costs.json"),
               json=os.path.join(out_dir, "profile.json"),
               markdown=os.path.join(out_dir, "profile.md"))
  table.save(paths["costs"])
  with open(paths["json"], "w") as f:
    json.dump(dict(result, costs=table.to_json()), f, indent=1, default=str)
  with open(paths["markdown"], "w") as f:
    f.write(markdown(result, table))
  return paths
