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
               "sampling": "sampling smoke test (temperature 1)",
               "fixed_int8": "greedy fixed-width int8 weights (exact)"}
# Measurements: an error in one makes the verdict FAIL too; a skipped prefill length does not.
MEASUREMENTS = {"speed": "speed in the decode loop", "prefill": "prefill tokens/s",
                "attention": "prefill attention implementations",
                "long_cache": "decode after a long prompt"}


def check_status(result: dict, name: str) -> str | None:
  """PASS / FAIL of a correctness check, OK / ERROR of a measurement, PASS / NOTE / FAIL /
  ERROR of the int8 part (`quantized`); None: not run."""
  if name == "int8":
    e = result.get("int8")
    return None if e is None else "ERROR" if "error" in e else e.get("status")
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
  status = check_status(result, "int8")
  if status is not None:
    # NOTE: the CPU converts the weights first, as expected there (`quantized`).
    ok = ok and status in ("PASS", "NOTE")
    parts.append("int8 " + {"NOTE": "NOTE (converted first on cpu)"}.get(status, status))
  copies = result.get("loop_copies")
  if copies:
    # A count, not a verdict: copies cost time, not correctness.
    if any("error" in e for e in copies.values()):
      parts.append("loop_copies ERROR")
      ok = False
    else:
      parts.append(f"loop_copies {sum(c['count'] for e in copies.values() for c in e.values())}")
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
      for name, label in (("ar", "ar"), ("ar_fixed", "ar"),
                          ("dloop", f"dloop round ({shape.get('max_stages')} stages)")):
        e = entry.get(name)
        if not e:
          continue
        # The width the loop's forwards ran at, from the runs' statistics (not the one asked).
        label = f"{label} (width {fmt(e.get('width'), '.0f')})"
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
        lines.append(f"| {p['length']} | {_unmeasured(p)} | – | – |")
      else:
        lines.append(f"| {p['length']} | {p['tokens_per_s']:,.0f} | {1e3 * p['seconds']:.1f} |"
                     f" {p['compile_seconds']:.1f} |")
  lines += _int8_section(result)
  lines += _kernel_sections(result)
  return "\n".join(lines) + "\n"


def _int8_section(result: dict) -> list[str]:
  """How the int8 forwards read their weights, and their ms against bf16 (`quantized`)."""
  e = result.get("int8")
  if e is None:
    return []
  lines = ["", "## Int8 weights: the weight-only products (standard form, bf16 compute)", ""]
  if "error" in e:
    return lines + [f"ERROR: {e['error']}"]
  lines += [f"**int8 {e['status']}**: {e['finding']}.", "",
            f"The compiled target forward (`decoding.costs.calibrate`'s program, batch"
            f" {e['batch_size']}) read for its int8 matrices (`dloop_jax.models.int8_hlo`):"
            " products that read an s8 matrix inside their kernel, against instructions that"
            " write an array as large as a matrix from one (a conversion or copy first). ms per"
            " forward: median of the isolated forward; the bf16 target's from the speed"
            " section (in this backend's product forms: XLA:CPU's own on a CPU).", "",
            "| width | int8 matrices | products reading int8 (of expected) | written whole |"
            " kernels | int8 ms | bf16 ms | int8 / bf16 | HLO |",
            "|---|---|---|---|---|---|---|---|---|"]
  for w, f in e["forwards"].items():
    kernels = ", ".join(f"{k} {n}" for k, n in f["kernels"].items()) or "–"
    lines.append(f"| {w} | {f['weights']} | {f['products']} ({e['expected_products']}) |"
                 f" {len(f['whole'])} | {kernels} | {fmt(e['cost_ms'].get(w), '.3f')} |"
                 f" {fmt(e['bf16_cost_ms'].get(w), '.3f')} |"
                 f" {fmt(e['int8_over_bf16'].get(w), '.2f', '×')} | {f.get('hlo') or '–'} |")
  for w, f in e["forwards"].items():
    if f["whole"]:
      lines += ["", f"Written whole at width {w} (first 4 of {len(f['whole'])}): "
                + "; ".join(f"`{x}`" for x in f["whole"][:4])]
    if f["other"]:
      lines += ["", f"Other uses at width {w} (first 4 of {len(f['other'])}): "
                + "; ".join(f"`{x}`" for x in f["other"][:4])]
  return lines


def _unmeasured(entry: dict) -> str:
  """'skipped: why' or 'error: why' of a measurement that did not run."""
  return ("skipped: " + str(entry["skipped"]) if "skipped" in entry
          else "error: " + str(entry.get("error")))


def _gib(n) -> str:
  return "–" if n is None else f"{n / 2 ** 30:.2f} GiB"


def _kernel_sections(result: dict) -> list[str]:
  """The attention, long-cache, loop-copy, memory and compile-time sections."""
  lines = []
  attention = result.get("attention")
  if attention is not None:
    lines += ["", "## Prefill attention (bf16, batch 1, one prompt)", "",
              "cuDNN flash attention (`jax.nn.dot_product_attention(implementation=\"cudnn\")`)"
              " against the XLA path on a GPU; elsewhere XLA's `dot_product_attention` stands in"
              " for cuDNN. max |Δ|: the largest difference of the prompt's last logits from the"
              " XLA path's.", "",
              "| tokens | attention | tokens/s | ms | max abs diff | compile s |",
              "|---|---|---|---|---|---|"]
    for e in attention:
      if "tokens_per_s" in e:
        lines.append(f"| {e['length']} | {e['impl']} | {e['tokens_per_s']:,.0f} |"
                     f" {1e3 * e['seconds']:.1f} | {e['max_abs_diff']:.3g} |"
                     f" {e['compile_seconds']:.1f} |")
      else:
        lines.append(f"| {e.get('length', '–')} | {e.get('impl', '–')} | {_unmeasured(e)} |"
                     " – | – | – |")
  long_cache = result.get("long_cache")
  if long_cache is not None:
    lines += ["", "## Decode after a long prompt (bf16, batch 1, width 1)", "",
              "ms per `ar` step from two runs of one program (prefill cancelled); every step"
              " attends over the cache's whole capacity.", "",
              "| prompt tokens | cache slots | ms / step | tokens/s | compile s |",
              "|---|---|---|---|---|"]
    for e in long_cache:
      if "skipped" in e or "error" in e:
        lines.append(f"| {e.get('context', '–')} | {_unmeasured(e)} | – | – | – |")
      else:
        lines.append(f"| {e['context']} | {e['capacity']} | {fmt(e['ms_per_iteration'], '.3f')}"
                     f" | {fmt(e.get('tokens_per_s'), ',.0f')} | {e['compile_seconds']:.1f} |")
  copies = result.get("loop_copies")
  if copies:
    lines += ["", "## Cache copies inside the decode loops (optimized programs)", "",
              "| programs | program | copies | where |", "|---|---|---|---|"]
    for label, entry in copies.items():
      if "error" in entry:
        lines.append(f"| {label} | – | error: {entry['error']} | – |")
        continue
      for name, c in entry.items():
        lines.append(f"| {label} | {name} | {c['count']} | {'; '.join(c['copies'][:4]) or '–'} |")
  memory = result.get("memory")
  if memory is not None:
    lines += ["", "## Memory", "", "Peak device memory in use: "
              + (f"{_gib(memory['peak_bytes'])} of {_gib(memory.get('limit_bytes'))}."
                 if "peak_bytes" in memory else f"n/a ({memory['n/a']}).")]
  compiles = compile_seconds(result)
  if compiles:
    lines += ["", "## Compile seconds per program", "", "| program | compile s |", "|---|---|"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in compiles]
  return lines


def compile_seconds(result: dict) -> list[tuple[str, float]]:
  """(program, seconds) of every program the check compiled (0: loaded from JAX's cache or
  shared with an earlier run of the same program; those are left out)."""
  out = []
  for check, by_batch in result.get("correctness", {}).items():
    for batch, entry in by_batch.items():
      for mode, run in entry.get("runs", {}).items():
        out.append((f"{check} {mode}, batch {batch}", run.get("compile_seconds")))
  for w, f in (result.get("int8") or {}).get("forwards", {}).items():
    out.append((f"int8 forward, width {w}", f.get("compile_seconds")))
  for p in result.get("prefill", []):
    out.append((f"prefill {p['length']}", p.get("compile_seconds")))
  for e in result.get("attention", []):
    out.append((f"prefill forward {e.get('length')}, {e.get('impl')}", e.get("compile_seconds")))
  for e in result.get("long_cache", []):
    out.append((f"ar after {e.get('context')} tokens", e.get("compile_seconds")))
  return [(name, s) for name, s in out if s]


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
