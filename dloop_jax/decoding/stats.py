"""What `generate()` returns: tokens and per-row / total statistics."""

from __future__ import annotations

import dataclasses

import numpy as np


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

  @property
  def total(self) -> RowStats:
    """Statistics summed over rows."""
    hist_len = max((len(r.stage_histogram) for r in self.rows), default=0)
    hist = [sum(r.stage_histogram[i] for r in self.rows if i < len(r.stage_histogram))
            for i in range(hist_len)]
    return RowStats(
        new_tokens=sum(r.new_tokens for r in self.rows),
        rounds=sum(r.rounds for r in self.rows),
        committed_in_rounds=sum(r.committed_in_rounds for r in self.rows),
        drafted=sum(r.drafted for r in self.rows),
        verified=sum(r.verified for r in self.rows),
        plain_rounds=sum(r.plain_rounds for r in self.rows),
        accepted=sum(r.accepted for r in self.rows),
        drafter_forwards=sum(r.drafter_forwards for r in self.rows),
        target_tokens=sum(r.target_tokens for r in self.rows),
        stage_histogram=hist,
        lookup_rounds=sum(r.lookup_rounds for r in self.rows))

  @property
  def tokens_per_second(self) -> float:
    return self.total.new_tokens / self.seconds if self.seconds > 0 else 0.0
