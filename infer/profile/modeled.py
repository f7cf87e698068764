"""Modeled speedups: what a given acceptance length tau would buy on the measured device.

Nothing here is measured end to end. A round that drafts S stages of gamma
tokens and verifies them all costs

    t_round(S) = T(1 + S * gamma) + S * t_stage + t_commit

(T: the target's per-width forward cost, t_stage / t_commit: the drafter's,
all measured); autoregressive decoding costs T(1) per token. A method that
commits tau tokens per round is then modeled at

    speedup = tau * T(1) / t_round(S)

and breaks even at tau = t_round(S) / T(1). The tau values are inputs: the
papers' (with their sources) or the user's. Scheduling, back-off, prefill and
the engine's own overhead are left out; `measure.generation_rate` times a
whole generation for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dloop_jax.decoding import costs as costs_lib
from dloop_jax.errors import ConfigError

# Published acceptance lengths of the drafters DLoop applies to, on Qwen3
# targets (each at its paper's block size / budget and settings; sd, one stage).
PAPER_TAUS = (
    dict(kind="eagle3", tau=4.86, source="EAGLE-3, Qwen3-8B, 16-token budget (Domino paper)"),
    dict(kind="block", tau=4.03, source="DFlash, Qwen3-8B, 16-token budget (Domino paper)"),
    dict(kind="domino", tau=4.70, source="Domino, Qwen3-8B, 16-token budget (Domino paper)"),
    dict(kind="block", tau=7.79, source="DFlash, Qwen3-8B MATH-500, block 16 (DDTree paper)"),
    dict(kind="dspark", tau=6.11, source="DSpark, Qwen3-4B GSM8K, block 7, T=1 (DSpark paper)"),
)


def parse_taus(text: str, kinds: Sequence[str]) -> list[dict]:
  """"paper" -> PAPER_TAUS (of the measured kinds); "4,6.5" -> those tau for every kind."""
  entries = []
  for item in (s.strip() for s in text.split(",")):
    if not item:
      continue
    if item == "paper":
      entries += [dict(e) for e in PAPER_TAUS if e["kind"] in kinds]
      continue
    try:
      tau = float(item)
    except ValueError:
      raise ConfigError(f"--tau takes 'paper' and numbers >= 1 separated by commas; got"
                        f" {item!r}.") from None
    if not tau >= 1.0:
      raise ConfigError(f"--tau values are tokens per round, >= 1; got {tau}.")
    entries += [dict(kind=k, tau=tau, source="given") for k in kinds]
  return entries


def round_ms(table: costs_lib.CostTable, drafter: Mapping[str, float], *, block_size: int,
             stages: int) -> float | None:
  """t_round(S) in ms, or None when the table does not reach width 1 + S * gamma."""
  width = 1 + stages * block_size
  if width > table.widths[-1]:
    return None
  return (float(table.at([width])[0]) + stages * drafter["stage_ms"] + drafter["commit_ms"])


def speedups(table: costs_lib.CostTable, drafters: Mapping[str, Mapping[str, float]], *,
             block_size: int, max_stages: int, entries: Sequence[Mapping]) -> dict:
  """The modeled table.

  Args:
    table: target forward cost per width.
    drafters: {kind: {"stage_ms", "commit_ms"}}.
    block_size: gamma of the measured stages.
    max_stages: S up to which rounds are modeled.
    entries: {"kind", "tau", "source"} rows.

  Returns:
    {"stages": [1..S], "break_even": {kind: [tau per S]}, "rows": [entry +
    "speedup": [per S]]}; None where the width is not measured or tau exceeds
    the 1 + S * gamma tokens a round can commit.
  """
  step = table.costs[1]
  stages = list(range(1, max_stages + 1))
  rounds = {k: [round_ms(table, d, block_size=block_size, stages=s) for s in stages]
            for k, d in drafters.items()}
  break_even = {k: [None if t is None else t / step for t in ts] for k, ts in rounds.items()}
  rows = []
  for e in entries:
    if e["kind"] not in rounds:
      continue
    row = dict(e)
    row["speedup"] = [
        None if t is None or e["tau"] > 1 + s * block_size else e["tau"] * step / t
        for s, t in zip(stages, rounds[e["kind"]])]
    rows.append(row)
  return dict(label="modeled", stages=stages, block_size=block_size, ar_step_ms=step,
              round_ms=rounds, break_even=break_even, rows=rows)
