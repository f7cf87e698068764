"""How far a drafter's confidence can be trusted: what a stage of drafts yields, by its score.

DLoop's gate reads one number per drafted stage, its score

    u = sum_k log c_k      (k over the stage's gamma drafts; c_k the drafter's
                            probability of its draft, or its learned confidence)

and `gate="auto"` (`decoding.gate`) turns that score into expected tokens with
this table: per score bin, measured teacher-forced on held-out answers
(`dloop_jax.training.calibration`),

    full           P(the stage's drafts are all accepted | the earlier stages'
                   were, its score)
    accepted       E(drafts of the stage accepted | the earlier stages' were,
                   its score)
    next_accepted  E(drafts of the *following* stage accepted | this stage and
                   the earlier ones were, this stage's score): what drafting
                   one more stage adds, known before it is drafted

in two rows: the round's first stage (drafted from the target's features) and
the looped stages after it (drafted from the drafter's own hidden states,
DLoop's loop), which a drafter predicts less well at the same score.

Bins: the score's range is cut at `EDGES` (a score u falls in bin
`searchsorted(EDGES, u, side="right")`, so bin 0 holds u < -12 and the last
bin u >= -0.3). A bin's estimate is shrunk towards its row's pooled value
with the weight of `PRIOR` samples, so bins with few samples (or none) say
what the row says on average instead of 0/0; the standard errors are those of
the binned means (binomial for `full`, the sample's for the others).

A drafter's tables travel in its export (`drafter.json`, key "calibration":
one table per score and gamma, named "probability/gamma4" (`name_of`); a
drafter with a learned confidence head also has "learned/gamma4"), as many
gammas as were measured (`python -m train.calibrate --block-size`);
`load_drafter` attaches them to the drafter (`attach`, `of`), and the engine
reads the one of the round's gamma. `DecodingConfig(calibration=...)`
overrides them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dloop_jax.errors import ConfigError

FORMAT = "dloop_jax.calibration/1"
# Upper edges of the score bins (the last bin is open above).
EDGES = (-12.0, -8.0, -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.6, -0.3)
NUM_BINS = len(EDGES) + 1
ROWS = ("first", "looped")
# Samples' weight of a row's pooled value in each bin's estimate.
PRIOR = 4.0
SCORES = ("probability", "learned")
_FIELDS = ("count", "full", "full_se", "accepted", "accepted_se", "next_count", "next_accepted",
           "next_accepted_se")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A drafter's stage outcomes by stage score (module docstring).

  Every array is [len(ROWS), NUM_BINS] float64: row 0 the round's first stage,
  row 1 the looped stages.

  Attributes:
    block_size: gamma of the measured stages.
    score: "probability" (the drafter's log-probabilities) or "learned" (its
      confidence head's).
    count: stages measured per bin.
    full, full_se: P(stage fully accepted), its standard error.
    accepted, accepted_se: E(accepted drafts of the stage).
    next_count: stages per bin that a following stage was measured after
      (the stage and the earlier ones fully accepted).
    next_accepted, next_accepted_se: E(accepted drafts of the following stage).
    source: what it was measured on (free text: drafter, target, prompts).
  """

  block_size: int
  score: str
  count: np.ndarray
  full: np.ndarray
  full_se: np.ndarray
  accepted: np.ndarray
  accepted_se: np.ndarray
  next_count: np.ndarray
  next_accepted: np.ndarray
  next_accepted_se: np.ndarray
  source: str = ""

  def __post_init__(self):
    if self.score not in SCORES:
      raise ConfigError(f"A calibration's score must be one of {SCORES}, got {self.score!r}.")
    if not isinstance(self.block_size, int) or self.block_size < 1:
      raise ConfigError(f"A calibration's block_size must be an int >= 1, got {self.block_size!r}.")
    for name in _FIELDS:
      value = np.asarray(getattr(self, name), np.float64)
      if value.shape != (len(ROWS), NUM_BINS) or not np.all(np.isfinite(value)):
        raise ConfigError(f"Calibration field {name!r} must be a finite [{len(ROWS)},"
                          f" {NUM_BINS}] array (score bins at {list(EDGES)}), got shape"
                          f" {value.shape}.")
      object.__setattr__(self, name, value)
    if np.any(self.full < 0) or np.any(self.full > 1):
      raise ConfigError("Calibration 'full' holds probabilities: values must be in [0, 1].")
    for name in ("accepted", "next_accepted"):
      if np.any(getattr(self, name) < 0) or np.any(getattr(self, name) > self.block_size):
        raise ConfigError(f"Calibration {name!r} holds accepted drafts of a stage: values must"
                          f" be in [0, block_size={self.block_size}].")

  def to_json(self) -> dict[str, Any]:
    out = {"format": FORMAT, "block_size": self.block_size, "score": self.score,
           "edges": list(EDGES), "rows": list(ROWS), "source": self.source}
    for name in _FIELDS:
      out[name] = np.round(getattr(self, name), 6).tolist()
    return out

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> "Calibration":
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
      raise ConfigError(f"Not a drafter calibration table (format {FORMAT!r} expected, got"
                        f" {data.get('format') if isinstance(data, Mapping) else data!r}).")
    try:
      edges = [float(e) for e in data.get("edges", ())]
    except (TypeError, ValueError):
      edges = None
    if edges != list(EDGES):
      raise ConfigError(f"Calibration table measured with score bins {data.get('edges')}, this"
                        f" version reads {list(EDGES)}: measure it again (python -m"
                        " train.calibrate).")
    missing = [name for name in _FIELDS + ("block_size", "score") if name not in data]
    if missing:
      raise ConfigError(f"Calibration table lacks {missing}.")
    try:
      block_size = data["block_size"]
      if isinstance(block_size, bool) or int(block_size) != block_size:
        raise ValueError(f"block_size {block_size!r} is not an integer")
      fields = {name: np.asarray(data[name], np.float64) for name in _FIELDS}
    except (TypeError, ValueError) as e:
      raise ConfigError(f"Calibration table has a malformed value: {e}.") from None
    return cls(block_size=int(block_size), score=str(data["score"]),
               source=str(data.get("source", "")), **fields)

  def format(self) -> str:
    """A markdown table: per bin and row, stages, P(full) ± SE, E(accepted), E(next)."""
    lines = [f"score: {self.score}, gamma {self.block_size}" + (f", {self.source}"
                                                                 if self.source else ""),
             "| stage score u | row | stages | P(full) ± SE | E(accepted) ± SE"
             " | after full: stages | E(next stage accepted) ± SE |",
             "|---|---|---|---|---|---|---|"]
    for b in range(NUM_BINS):
      lo = "-inf" if b == 0 else f"{EDGES[b - 1]:g}"
      hi = "0" if b == NUM_BINS - 1 else f"{EDGES[b]:g}"
      for r, row in enumerate(ROWS):
        if self.count[r, b] == 0 and self.next_count[r, b] == 0:
          continue
        lines.append(
            f"| [{lo}, {hi}) | {row} | {self.count[r, b]:.0f} | {self.full[r, b]:.3f} ±"
            f" {self.full_se[r, b]:.3f} | {self.accepted[r, b]:.2f} ±"
            f" {self.accepted_se[r, b]:.2f} | {self.next_count[r, b]:.0f} |"
            f" {self.next_accepted[r, b]:.2f} ± {self.next_accepted_se[r, b]:.2f} |")
    return "\n".join(lines)


def bin_of(score: np.ndarray) -> np.ndarray:
  """Bin index of each stage score (host side; `gate` has the traced twin of one line)."""
  return np.searchsorted(np.asarray(EDGES), np.asarray(score, np.float64), side="right")


def _shrunk(total: np.ndarray, count: np.ndarray, pooled: float) -> np.ndarray:
  return (total + PRIOR * pooled) / (count + PRIOR)


def _mean_se(values: Sequence[float]) -> float:
  n = len(values)
  return float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else 0.0


def from_samples(*, scores: np.ndarray, accepted: np.ndarray, block_size: int, score: str,
                 source: str = "") -> Calibration:
  """The table of measured stages.

  Args:
    scores: [N, S] score of stage s drafted at each of N measured positions
      (every position drafts S stages; S >= 1).
    accepted: [N, S] int, leading drafts of stage s equal to the held-out
      answer there; -1 where the answer ends before the stage does (not
      counted).
    block_size: gamma.
    score: which score `scores` holds ("probability" or "learned").
    source: free text stored with the table.

  A stage counts only where every stage before it was fully accepted (a
  looped stage is verified only then); its following stage is measured where
  it was fully accepted too.
  """
  scores = np.asarray(scores, np.float64)
  accepted = np.asarray(accepted, np.int64)
  if scores.ndim != 2 or scores.shape != accepted.shape:
    raise ValueError(f"scores and accepted must both be [N, S], got {scores.shape} and"
                     f" {accepted.shape}.")
  n, s = scores.shape
  groups = {(r, b): [] for r in range(len(ROWS)) for b in range(NUM_BINS)}
  nexts = {(r, b): [] for r in range(len(ROWS)) for b in range(NUM_BINS)}
  bins = bin_of(scores)
  for i in range(n):
    for j in range(s):
      if accepted[i, j] < 0:
        break
      row = min(j, 1)
      groups[row, bins[i, j]].append(accepted[i, j])
      if accepted[i, j] < block_size:
        break
      if j + 1 < s and accepted[i, j + 1] >= 0:
        nexts[row, bins[i, j]].append(accepted[i, j + 1])
  shape = (len(ROWS), NUM_BINS)
  out = {name: np.zeros(shape) for name in _FIELDS}
  looped = [a for b in range(NUM_BINS) for a in groups[1, b]]
  for r in range(len(ROWS)):
    row_acc = [a for b in range(NUM_BINS) for a in groups[r, b]]
    row_next = [a for b in range(NUM_BINS) for a in nexts[r, b]]
    if r and not row_acc:
      # No looped stage reached: its estimates are the first stage's row, but
      # nothing was measured there (counts 0).
      for name in _FIELDS:
        out[name][r] = 0.0 if name in ("count", "next_count") else out[name][0]
      continue
    pooled_full = float(np.mean([a == block_size for a in row_acc])) if row_acc else 0.0
    pooled_acc = float(np.mean(row_acc)) if row_acc else 0.0
    # No following stage measured after a row's full stages: assume it yields
    # what the looped row's stages yield on average (0 when nothing says more).
    pooled_next = (float(np.mean(row_next)) if row_next else
                   float(np.mean(looped)) if looped else 0.0)
    for b in range(NUM_BINS):
      acc = np.asarray(groups[r, b], np.float64)
      nxt = np.asarray(nexts[r, b], np.float64)
      out["count"][r, b] = len(acc)
      out["full"][r, b] = _shrunk(np.sum(acc == block_size), len(acc), pooled_full)
      out["full_se"][r, b] = math.sqrt(out["full"][r, b] * (1 - out["full"][r, b])
                                       / max(len(acc), 1))
      out["accepted"][r, b] = _shrunk(np.sum(acc), len(acc), pooled_acc)
      out["accepted_se"][r, b] = _mean_se(acc)
      out["next_count"][r, b] = len(nxt)
      out["next_accepted"][r, b] = _shrunk(np.sum(nxt), len(nxt), pooled_next)
      out["next_accepted_se"][r, b] = _mean_se(nxt)
  return Calibration(block_size=int(block_size), score=score, source=source, **out)


def name_of(table: Calibration) -> str:
  """A table's name in an export: its score and gamma ("probability/gamma4")."""
  return f"{table.score}/gamma{table.block_size}"


def named(tables: Mapping[str, Calibration] | Sequence[Calibration]) -> dict[str, Calibration]:
  """{`name_of`: table} of tables given as a mapping or a sequence."""
  values = tables.values() if isinstance(tables, Mapping) else tables
  return {name_of(t): t for t in values}


def merged(old: Mapping[str, Calibration], new: Mapping[str, Calibration] | Sequence[Calibration]
           ) -> dict[str, Calibration]:
  """`old` with `new` added: a table of the same score and gamma replaced, the others kept."""
  return {**named(old), **named(new)}


def tables_from_json(data: Mapping[str, Any] | None) -> dict[str, Calibration]:
  """{name: table} of an export's "calibration" entry (None: no table)."""
  if data is None:
    return {}
  if not isinstance(data, Mapping):
    raise ConfigError("An export's 'calibration' must map a table's name to the table.")
  return named([Calibration.from_json(table) for table in data.values()])


def load(path: str | os.PathLike) -> dict[str, Calibration]:
  """{name: table} from a JSON file: one table, or {name: table}."""
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"Calibration file {os.fspath(path)!r} does not exist.") from None
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"Calibration file {os.fspath(path)!r} could not be read: {e}.") from None
  if isinstance(data, Mapping) and data.get("format") == FORMAT:
    return named([Calibration.from_json(data)])
  return tables_from_json(data)


# The tables of loaded drafters, kept beside them (not on the module: a static
# attribute would enter the drafter's graph and the compile key).
_ATTACHED: "weakref.WeakKeyDictionary[Any, dict[str, Calibration]]" = weakref.WeakKeyDictionary()


def attach(drafter: Any, tables: Mapping[str, Calibration] | Sequence[Calibration]) -> None:
  """Keeps `tables` as `drafter`'s calibration."""
  _ATTACHED[drafter] = named(tables)


def of(drafter: Any) -> dict[str, Calibration]:
  """{name: table} attached to `drafter` ({} when none)."""
  try:
    return dict(_ATTACHED.get(drafter, {}))
  except TypeError:  # an object that cannot be weakly referenced
    return {}


def resolve(value: Any, *, drafter: Any, score: str, block_size: int) -> Calibration | None:
  """The table `gate="auto"` reads for stages of `block_size` drafts scored by `score`:
  from `value` (a Calibration, a mapping or sequence of them, or a JSON path) or, when
  None, the drafter's own; a "learned" score falls back to the "probability" table (the
  engine then scores with probabilities). None when there is none."""
  if value is None:
    tables = of(drafter)
  elif isinstance(value, Calibration):
    tables = named([value])
  elif isinstance(value, (Mapping, list, tuple)):
    tables = named(value)
  elif isinstance(value, (str, os.PathLike)):
    tables = load(value)
  else:
    raise ConfigError("calibration must be None (the drafter's own), a Calibration, a mapping"
                      " or sequence of them, or the path of a JSON table, got"
                      f" {type(value).__name__}.")
  for wanted in ((score, "probability") if score == "learned" else (score,)):
    for table in tables.values():
      if table.score == wanted and table.block_size == block_size:
        return table
  return None
