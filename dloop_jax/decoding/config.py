"""`DecodingConfig`: every choice of how `generate()` decodes, in one frozen object.

    config = DecodingConfig(mode="dloop", gate=-0.75)
    out = generate(target, prompts, max_new_tokens=64, drafter=drafter, config=config)
    out = generate(target, prompts, max_new_tokens=64, drafter=drafter, config=config,
                   gate=-1.0)                            # a keyword overrides a field
    wider = config.replace(max_stages=4)

This class is the one place a decoding default is written: the command lines
(`python -m infer`, `python -m infer.bench`, `python -m train.evaluate`) take
their flags from its fields (`decoding.flags`, every flag's default None), and
the benchmark's methods and the trainer's engine evaluation each hold one.
Fields left None take the backend profile's defaults when `resolve` fills
them in against a target and a drafter, the one resolution `generate()`, the
command line and the benchmark share; loading (weights, compute dtype) is
`load_target`'s, with the same profile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dloop_jax import profiles
from dloop_jax.decoding import arguments
from dloop_jax.decoding import calibration as calibration_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.errors import ConfigError

# Longest drafting pause (rounds) by default with schedule="cost". Where a
# drafting stage costs a sizable part of a target step (CPUs), a drafter that
# keeps failing is worth pausing for long (measured against 8: docs/benchmarks.md,
# the drafting back-off); a pause that long needs 7 fruitless drafting rounds in
# a row, and the first accepted draft resets it. At a fixed width (schedule
# "off") a paused step costs what a verification costs, so a pause saves only
# the drafting stage and gives up drafts the forward would have verified at no
# extra cost: no back-off (docs/decoding.md, the drafting back-off).
DEFAULT_DRAFT_BACKOFF = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodingConfig:
  """How to decode (see `generate()` for each field's meaning).

  Attributes:
    mode: "ar", "sd" or "dloop".
    block_size: gamma, drafts per stage (None: the drafter's, or what a fixed
      width holds).
    gate: DLoop's confidence gate g, or "auto": another stage when the
      drafter's calibration says its expected tokens pay for its cost on this
      machine (`decoding.gate`).
    max_stages: S_max (None: 3, or what a fixed width holds).
    schedule: "cost", "off" or None (cost at free widths, off otherwise).
    confidence: the cost scheduler's c_k: "auto", "drafter" or "probability".
    tree_budget: nodes per stage of a draft tree; 0 for chains.
    fixed_width: the width of every forward after prefill; 0 free widths;
      None the profile's (16-bit targets) or free (f32 targets).
    draft_backoff: longest drafting pause in rounds (None:
      `DEFAULT_DRAFT_BACKOFF` with schedule "cost", else 0).
    costs: the scheduler's cost table (None: cached or the profile's default).
    calibration: gate="auto"'s table (`decoding.calibration`): a
      `Calibration`, {score: Calibration} or a JSON path; None: the one the
      drafter's export holds.
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
  gate: float | str = -0.5
  max_stages: int | None = None
  schedule: str | None = None
  confidence: str = "auto"
  tree_budget: int = 0
  fixed_width: int | None = None
  draft_backoff: int | None = None
  costs: Any = None
  calibration: Any = None
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


def calibration_table(config: DecodingConfig, *, drafter) -> "calibration_lib.Calibration | None":
  """The calibration gate="auto" reads (`config` resolved): the config's or the drafter's,
  for its block size and the score the engine gives it (the learned confidence where the
  scheduler uses it, else the drafter's probabilities)."""
  learned = (config.confidence != "probability" and drafter is not None
             and drafter.has_confidence)
  return calibration_lib.resolve(config.calibration, drafter=drafter,
                                 score="learned" if learned else "probability",
                                 block_size=config.block_size)


FIELDS = frozenset(f.name for f in dataclasses.fields(DecodingConfig))


def check(config: DecodingConfig) -> None:
  """Raises ConfigError for a value no target or drafter could run.

  The checks that need neither (`resolve` runs the others): a command line
  runs them before it loads anything.
  """
  if not isinstance(config, DecodingConfig):
    raise ConfigError(f"config must be a DecodingConfig, got {type(config).__name__}.")
  c = config
  arguments.validate_values(mode=c.mode, block_size=c.block_size, gate=c.gate,
                            max_stages=c.max_stages, schedule=c.schedule,
                            draft_backoff=c.draft_backoff, tree_budget=c.tree_budget,
                            confidence=c.confidence, fixed_width=c.fixed_width)
  if not isinstance(c.sampling, sampling_lib.SamplingConfig):
    raise ConfigError("sampling must be a SamplingConfig.")
  lookup_lib.validate(lookup=c.lookup, min_match=c.lookup_min_match,
                      max_probability=c.lookup_max_probability, mode=c.mode,
                      greedy=c.sampling.greedy, tree_budget=c.tree_budget)
  if not (isinstance(c.width_tolerance, (int, float)) and c.width_tolerance >= 0):
    raise ConfigError(f"width_tolerance must be a number >= 0 (0 compiles every width), got"
                      f" {c.width_tolerance!r}.")
  if isinstance(c.profile, str):
    profiles.resolve(c.profile)  # the name


def resolve(config: DecodingConfig, *, target, drafter=None) -> DecodingConfig:
  """`config` resolved for `target` and `drafter`, or a ConfigError saying what to change.

  The one resolution of a decoding config: `generate()` runs what it returns,
  the command line reports it and the benchmark enumerates candidate configs
  through it (skipping those it refuses). Every None is filled in
  (`resolved`: block_size, max_stages, schedule, fixed_width and lookup from
  the profile; draft_backoff by the schedule), and every check that needs no
  prompt runs: exactness of 16-bit targets, fixed widths, the drafter's fit,
  trees, the lookup stage.

  Args:
    config: the options.
    target: the target `Transformer` (its weight / compute dtypes and config).
    drafter: the drafter of "sd" / "dloop" (None for "ar").
  """
  check(config)
  c = config.resolved(target=target, drafter=drafter)
  arguments.validate_exactness(target=target, mode=c.mode, fixed_width=c.fixed_width,
                               tree_budget=c.tree_budget, allow_inexact=c.allow_inexact)
  arguments.validate_fixed_width(fixed_width=c.fixed_width, mode=c.mode,
                                 block_size=c.block_size, max_stages=c.max_stages,
                                 schedule=c.schedule, tree_budget=c.tree_budget)
  arguments.validate(mode=c.mode, drafter=drafter, block_size=c.block_size, gate=c.gate,
                     max_stages=c.max_stages, target=target, schedule=c.schedule,
                     draft_backoff=c.draft_backoff, tree_budget=c.tree_budget,
                     confidence=c.confidence, fixed_width=c.fixed_width)
  lookup_lib.validate(lookup=c.lookup, min_match=c.lookup_min_match,
                      max_probability=c.lookup_max_probability, mode=c.mode,
                      greedy=c.sampling.greedy, tree_budget=c.tree_budget)
  if c.mode == "dloop" and c.gate == arguments.AUTO_GATE and calibration_table(
      c, drafter=drafter) is None:
    raise ConfigError(
        f"gate='auto' reads the drafter's calibration table for stages of"
        f" block_size={c.block_size} drafts, and drafter {getattr(drafter, 'name', '?')!r} has"
        f" none: measure it with `python -m train.calibrate --drafters NAME_OR_PATH"
        f" --block-size {c.block_size} --write` (stored in its drafter.json), pass"
        " calibration=... (a table or its JSON file), or give gate a number.")
  if c.draft_backoff is None:
    cost = c.mode != "ar" and c.schedule == "cost"
    c = dataclasses.replace(c, draft_backoff=DEFAULT_DRAFT_BACKOFF if cost else 0)
  return c
