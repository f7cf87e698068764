"""`DecodingConfig`: every choice of how `generate()` decodes, in one frozen object.

    config = DecodingConfig(mode="dloop", gate=-0.75)
    out = generate(target, prompts, max_new_tokens=64, drafter=drafter, config=config)
    out = generate(target, prompts, max_new_tokens=64, drafter=drafter, config=config,
                   gate=-0.5)                            # a keyword overrides a field
    wider = config.replace(max_stages=4)

The command line (`python -m infer`), the benchmark and the trainer's engine
evaluation build one of these instead of repeating the options. Fields left
None take the backend profile's defaults when `generate()` resolves them
against a target and a drafter (`resolved`); loading (weights, compute
dtype) is `load_target`'s, with the same profile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dloop_jax.decoding import arguments
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodingConfig:
  """How to decode (see `generate()` for each field's meaning).

  Attributes:
    mode: "ar", "sd" or "dloop".
    block_size: gamma, drafts per stage (None: the drafter's, or what a fixed
      width holds).
    gate: DLoop's confidence gate g.
    max_stages: S_max (None: 3, or what a fixed width holds).
    schedule: "cost", "off" or None (cost at free widths, off otherwise).
    confidence: the cost scheduler's c_k: "auto", "drafter" or "probability".
    tree_budget: nodes per stage of a draft tree; 0 for chains.
    fixed_width: the width of every forward after prefill; 0 free widths;
      None the profile's (16-bit targets) or free (f32 targets).
    draft_backoff: longest drafting pause in rounds (None: by schedule).
    costs: the scheduler's cost table (None: cached or the profile's default).
    width_tolerance: with schedule="cost", a width whose forward costs within
      this fraction of a wider compiled width's is not compiled (the
      scheduler loses at most this fraction of a round's tokens per cost;
      0: compile every width; `schedule.choosable_widths`).
    sampling: greedy by default.
    lookup: "prompt": a row's first stage takes prompt-lookup drafts where the
      lookup matched and the drafter is unsure (`decoding.lookup`; greedy
      chains in sd / dloop); "off"; "auto" (default): "prompt" where it
      applies (greedy chains of sd / dloop), "off" elsewhere.
    lookup_min_match: the shortest matched suffix (tokens) the lookup stage uses.
    lookup_max_probability: the lookup stage replaces drafts whose first one
      the drafter gives a probability below this.
    profile: "cpu", "gpu", "tpu" or None (this backend's).
    allow_inexact: run a 16-bit target at free widths anyway.
  """

  mode: str = "ar"
  block_size: int | None = None
  gate: float = -0.5
  max_stages: int | None = None
  schedule: str | None = None
  confidence: str = "auto"
  tree_budget: int = 0
  fixed_width: int | None = None
  draft_backoff: int | None = None
  costs: Any = None
  width_tolerance: float = 0.02
  sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY
  lookup: str = "auto"
  lookup_min_match: int = 2
  lookup_max_probability: float = 0.5
  profile: str | None = None
  allow_inexact: bool = False

  def replace(self, **changes: Any) -> "DecodingConfig":
    """A copy with `changes`; an unknown field is a ConfigError naming the known ones."""
    unknown = sorted(set(changes) - FIELDS)
    if unknown:
      raise ConfigError(f"Unknown decoding option(s) {unknown}; DecodingConfig has"
                        f" {sorted(FIELDS)}.")
    return dataclasses.replace(self, **changes)

  def resolved(self, *, target, drafter=None) -> "DecodingConfig":
    """The config with the profile's defaults filled in for `target` and `drafter`
    (`arguments.resolve_shape`): block_size, max_stages, schedule and fixed_width set,
    and lookup "off" or "prompt" (`lookup.resolve`)."""
    shape = arguments.resolve_shape(
        target=target, mode=self.mode, drafter=drafter if self.mode != "ar" else None,
        block_size=self.block_size, max_stages=self.max_stages, schedule=self.schedule,
        fixed_width=self.fixed_width, tree_budget=self.tree_budget, profile=self.profile)
    lookup = lookup_lib.resolve(self.lookup, mode=self.mode,
                                greedy=getattr(self.sampling, "greedy", True),
                                tree_budget=self.tree_budget)
    return dataclasses.replace(self, block_size=shape.block_size, max_stages=shape.max_stages,
                               schedule=shape.schedule, fixed_width=shape.fixed_width,
                               lookup=lookup)


FIELDS = frozenset(f.name for f in dataclasses.fields(DecodingConfig))
