"""What `generate()` returns: tokens and per-row / total statistics.

`RowStats` is the one definition of the statistics: the decode program keeps
its counters (`COUNTERS`) as `DeviceStats`, a pytree of per-row arrays of the
same names, `to_rows` turns those into `RowStats`, and the benchmark records
`RowStats.as_dict()`; a new counter is a new field of `RowStats`, and
everything else follows from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(kw_only=True)
class RowStats:
  """Statistics of one row.

  Attributes:
    new_tokens: tokens generated (the first comes from the prefill forward).
    rounds: target forwards after the prefill (= verifications in sd / dloop).
    committed_in_rounds: tokens committed by those rounds (new_tokens - 1).
    drafted: draft tokens proposed.
    verified: drafts the target verified (all drafted ones unless the
      scheduler verified a shorter prefix).
    plain_rounds: rounds that verified no draft (a plain decode step).
    accepted: drafts accepted and committed.
    drafter_forwards: drafter forward passes (commits included).
    target_tokens: tokens read by target forwards after the prefill.
    stage_histogram: rounds by number of drafting stages (index = stages).
    lookup_rounds: rounds whose first stage took prompt-lookup drafts
      (`generate(lookup="prompt")`).
  """

  new_tokens: int
  rounds: int
  committed_in_rounds: int
  drafted: int = 0
  verified: int = 0
  plain_rounds: int = 0
  accepted: int = 0
  drafter_forwards: int = 0
  target_tokens: int = 0
  stage_histogram: list[int] = dataclasses.field(default_factory=list)
  lookup_rounds: int = 0

  @property
  def target_forwards(self) -> int:
    return self.rounds + 1

  @property
  def acceptance_length(self) -> float:
    """tau: tokens committed per target verification."""
    return self.committed_in_rounds / self.rounds if self.rounds else 0.0

  @property
  def stages_per_round(self) -> float:
    h = self.stage_histogram
    total = sum(h)
    return sum(i * c for i, c in enumerate(h)) / total if total else 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(target_forwards=self.target_forwards, acceptance_length=self.acceptance_length,
             stages_per_round=self.stages_per_round)
    return d


# The counters the decode program keeps per row: every field but `new_tokens`
# (the program's own output length).
COUNTERS = tuple(f.name for f in dataclasses.fields(RowStats) if f.name != "new_tokens")
HISTOGRAM = "stage_histogram"  # [B, S_max + 1]; the other counters are [B]

DeviceStats: Any = struct.dataclass(type("DeviceStats", (), {
    "__module__": __name__,
    "__qualname__": "DeviceStats",
    "__annotations__": {name: "jax.Array" for name in COUNTERS},
    "__doc__": "`RowStats`' counters inside the decode program, as int32 arrays ([B] each;"
               " stage_histogram [B, S_max + 1]: rounds by stages drafted).",
}))


def device_zeros(*, batch_size: int, max_stages: int, **start: jax.Array) -> Any:
  """`DeviceStats` of zeros, but for the counters given in `start`."""
  zero = jnp.zeros((batch_size,), jnp.int32)
  zeros = {name: zero for name in COUNTERS}
  zeros[HISTOGRAM] = jnp.zeros((batch_size, max_stages + 1), jnp.int32)
  return DeviceStats(**{**zeros, **start})


def to_rows(stats: Any, num_new: np.ndarray, *, speculative: bool) -> list[RowStats]:
  """One `RowStats` per row of the program's `DeviceStats` (fetched to the host).

  Args:
    stats: the program's counters.
    num_new: [B] new tokens per row.
    speculative: mode "sd" / "dloop" ("ar" counts no drafter forwards and
      keeps no stage histogram).
  """
  stats = jax.device_get(stats)
  rows = []
  for i, n in enumerate(np.asarray(num_new)):
    values = {name: int(getattr(stats, name)[i]) for name in COUNTERS if name != HISTOGRAM}
    values[HISTOGRAM] = ([int(x) for x in getattr(stats, HISTOGRAM)[i]] if speculative
                         else [])
    if not speculative:
      values["drafter_forwards"] = 0
    rows.append(RowStats(new_tokens=int(n), **values))
  return rows


@dataclasses.dataclass(kw_only=True)
class GenerationOutput:
  """Result of one `generate()` call.

  Attributes:
    tokens: new token ids per row (stop token included when one was hit).
    rows: per-row statistics.
    seconds: wall time of the compiled call (compilation excluded).
    compile_seconds: time spent compiling in this call (0 when cached).
    schedule: "cost" or "off" (sd / dloop; None for ar).
    fixed_width: the width of every forward after prefill (None: free widths).
    widths: the verification widths the program compiled (`decoding.schedule`).
    attention_kernels: the library attention kernels the program calls
      (`models.attention_kernels.recording`: "cudnn", "pallas_gpu_interpret",
      ...); empty: XLA's forms only.
    features: with `capture_taps`, per row [positions, n_taps, D] target taps
      at every position the target read (prompt + all new tokens but the last).
  """

  tokens: list[list[int]]
  rows: list[RowStats]
  seconds: float
  compile_seconds: float
  mode: str
  block_size: int | None = None
  gate: float | None = None
  max_stages: int | None = None
  schedule: str | None = None
  features: list[np.ndarray] | None = None
  fixed_width: int | None = None
  widths: tuple[int, ...] = ()
  attention_kernels: tuple[str, ...] = ()

  @property
  def total(self) -> RowStats:
    """Statistics summed over rows."""
    hist_len = max((len(r.stage_histogram) for r in self.rows), default=0)
    hist = [sum(r.stage_histogram[i] for r in self.rows if i < len(r.stage_histogram))
            for i in range(hist_len)]
    sums = {f.name: sum(getattr(r, f.name) for r in self.rows)
            for f in dataclasses.fields(RowStats) if f.name != HISTOGRAM}
    return RowStats(**sums, stage_histogram=hist)

  @property
  def tokens_per_second(self) -> float:
    return self.total.new_tokens / self.seconds if self.seconds > 0 else 0.0
