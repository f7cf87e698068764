"""The checks `generate()` runs on its arguments before anything is traced.

Every bad value is refused here with a `ConfigError` that names the argument
and what it accepts, instead of failing deep inside a trace.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from dloop_jax import profiles
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.errors import ConfigError
from dloop_jax.models import int8 as int8_lib
from dloop_jax.models.transformer import is_half

MODES = ("ar", "sd", "dloop")


def is_int(value) -> bool:
  """An int or a numpy integer; not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_mode(mode) -> None:
  if mode not in MODES:
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}.")


# gate="auto": the calibrated rule (`decoding.gate`).
AUTO_GATE = "auto"


def parse_gate(text: str) -> float | str:
  """A command line's gate: "auto" or a number."""
  if text.strip().lower() == AUTO_GATE:
    return AUTO_GATE
  try:
    return float(text)
  except ValueError:
    raise ValueError(f"gate must be a number or {AUTO_GATE!r}, got {text!r}") from None


def _positive(name: str, value) -> None:
  if not is_int(value) or value < 1:
    raise ConfigError(f"{name} must be an int >= 1, got {value!r}.")


def validate_values(*, mode, block_size, gate, max_stages, schedule, draft_backoff,
                    tree_budget, confidence, fixed_width) -> None:
  """The checks that need no target nor drafter (None: a value the profile fills in).

  A command line runs them before it loads anything; `validate` runs them again
  on the resolved values.
  """
  validate_mode(mode)
  if not is_int(tree_budget) or tree_budget < 0:
    raise ConfigError(f"tree_budget must be an int >= 0 (0 = chains), got {tree_budget!r}.")
  if tree_budget and mode == "ar":
    raise ConfigError("tree_budget > 0 needs mode 'sd' or 'dloop' (and a drafter).")
  if schedule is not None and schedule not in schedule_lib.SCHEDULES:
    raise ConfigError(f"schedule must be one of {schedule_lib.SCHEDULES}, got {schedule!r}.")
  if confidence not in schedule_lib.CONFIDENCES:
    raise ConfigError(f"confidence must be one of {schedule_lib.CONFIDENCES}, got"
                      f" {confidence!r}.")
  if draft_backoff is not None and (not is_int(draft_backoff) or draft_backoff < 0):
    raise ConfigError(f"draft_backoff must be None or an int >= 0 (rounds), got {draft_backoff!r}.")
  if fixed_width is not None and (not is_int(fixed_width) or fixed_width < 0):
    raise ConfigError(f"fixed_width must be an int >= 0 (0 = each forward as wide as its"
                      f" tokens), got {fixed_width!r}.")
  if mode == "ar":
    return
  if block_size is not None:
    _positive("block_size (gamma)", block_size)
  if max_stages is not None:
    _positive("max_stages (S_max)", max_stages)
  if gate == AUTO_GATE:
    return
  if (isinstance(gate, bool) or not isinstance(gate, (numbers.Real, np.floating, np.integer))
      or math.isnan(float(gate))):
    raise ConfigError(f"gate must be a number (-inf and +inf allowed) or {AUTO_GATE!r}, got"
                      f" {gate!r}.")


def validate(*, mode, drafter, block_size, gate, max_stages, target, schedule, draft_backoff,
             tree_budget, confidence, fixed_width) -> None:
  """Raises ConfigError, saying what to change, for resolved options `generate()` cannot run."""
  validate_values(mode=mode, block_size=block_size, gate=gate, max_stages=max_stages,
                  schedule=schedule, draft_backoff=draft_backoff, tree_budget=tree_budget,
                  confidence=confidence, fixed_width=fixed_width)
  if schedule is None:
    raise ConfigError(f"schedule must be one of {schedule_lib.SCHEDULES}, got None.")
  if mode == "ar":
    return
  if drafter is None:
    raise ConfigError(f"mode {mode!r} needs a drafter (pass drafter=...), or use mode='ar'.")
  _positive("block_size (gamma)", block_size)
  limit = drafter.max_block_size()
  if limit is not None and block_size > limit:
    raise ConfigError(f"block_size {block_size} exceeds what drafter {drafter.name!r} can draft"
                      f" in one stage ({limit}).")
  _positive("max_stages (S_max)", max_stages)
  drafter.check_target(target.config)
  if confidence == "drafter" and not drafter.has_confidence:
    raise ConfigError(f"confidence='drafter' needs a drafter with a learned confidence (DSpark's"
                      f" confidence head); drafter {drafter.name!r} has none: use"
                      " confidence='probability' (or 'auto').")
  validate_tree(drafter=drafter, tree_budget=tree_budget)


def validate_max_new_tokens(max_new_tokens) -> None:
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")


def asks_free_widths(*, fixed_width, schedule, tree_budget) -> bool:
  """Whether the options ask for free verification widths, whatever the profile:
  fixed_width=0, schedule "cost" or a draft tree (`resolve_shape`)."""
  return fixed_width == 0 or schedule == "cost" or (is_int(tree_budget) and tree_budget > 0)


def full_verification_width(*, mode: str, block_size: int, max_stages: int) -> int:
  """Tokens of a verification of every draft: 1 + stages * gamma (sd: one stage)."""
  return 1 + (1 if mode == "sd" else max_stages) * block_size


def loop_shape_for_width(width: int, *, drafter_block_size: int,
                         max_stages: int) -> tuple[int, int]:
  """(gamma, stages) of the DLoop a fixed `width` verifies whole: gamma at most the
  drafter's and at most (W - 1) / 2, so that at least two stages fit; then as many stages
  as fit, up to `max_stages` (W = 5, a drafter of 4: 2 stages of 2; W = 9: 2 of 4; W = 13,
  S_max = 3: 3 of 4).
  """
  gamma = min(drafter_block_size, (width - 1) // 2)
  if gamma < 1:
    raise ConfigError(f"fixed_width={width} leaves no room for two drafting stages (dloop needs"
                      " at least 1 + 2 x 1 = 3 tokens); pass a wider width.")
  return gamma, max(1, min(max_stages, (width - 1) // gamma))


def validate_fixed_width(*, fixed_width, mode, block_size, max_stages, schedule,
                         tree_budget) -> None:
  """`generate(fixed_width=...)`: every target forward at one width."""
  validate_values(mode=mode, block_size=None, gate=0.0, max_stages=None, schedule=None,
                  draft_backoff=None, tree_budget=0, confidence="auto", fixed_width=fixed_width)
  if not fixed_width or mode == "ar":
    return
  if is_int(tree_budget) and tree_budget > 0:
    raise ConfigError("fixed_width applies to chains of drafts; use tree_budget=0 with it.")
  if schedule != "off":
    raise ConfigError(f"fixed_width verifies every draft (a narrower verification would be"
                      f" another program shape): use schedule='off', got {schedule!r}.")
  stages = 1 if mode == "sd" else max_stages
  if not (is_int(block_size) and is_int(stages)):
    return  # `validate` names the bad value
  need = full_verification_width(mode=mode, block_size=block_size, max_stages=max_stages)
  if fixed_width < need:
    raise ConfigError(f"fixed_width={fixed_width} is narrower than a verification of every draft"
                      f" (1 + {stages} stage(s) x block_size {block_size} = {need} tokens):"
                      " pass at least that.")


def validate_tree(*, drafter, tree_budget) -> None:
  """The tree-specific part of `validate`."""
  if tree_budget == 0:
    return
  if not drafter.supports_trees:
    raise ConfigError(f"tree_budget > 0 needs a drafter that drafts trees; drafter"
                      f" {drafter.name!r} ({drafter.kind}) does not yet (use the block,"
                      " EAGLE-3 or Domino drafter, or tree_budget=0).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodingShape:
  """What a profile and the options decide before anything is traced.

  Attributes:
    block_size: gamma (None in mode "ar" without one given).
    max_stages: S_max (1 in mode "sd").
    schedule: "cost" or "off".
    fixed_width: W > 0 every forward after prefill W tokens wide; 0 free widths.
  """

  block_size: int | None
  max_stages: int
  schedule: str
  fixed_width: int


def is_16_bit(target) -> bool:
  """Whether `target` stores its weight matrices or computes in 16 bits, or stores them
  in int8 (`models.int8`): its products round to a few significant bits, so it
  takes the 16-bit rules (a fixed width, `validate_exactness`)."""
  return (is_half(target.weight_dtype) or is_half(target.dtype)
          or int8_lib.is_int8(target.weight_dtype))


def resolve_shape(*, target, mode, drafter, block_size, max_stages, schedule, fixed_width,
                  tree_budget, profile) -> DecodingShape:
  """The decoding shape from the options, the profile filling what is None.

  A 16-bit target's forwards run at the profile's fixed width W (`profiles`)
  unless the options ask for free widths (`fixed_width=0`, `schedule="cost"`,
  a draft tree); dloop then drafts the loop W verifies whole (W = 5: 2 stages
  of 2), sd min(gamma, W - 1) drafts, and options asking for more drafts than
  W holds widen W to 1 + stages * gamma, in every mode alike: `ar` with the
  same options runs at the same width, the exact reference of the others.
  An f32 target runs at free widths (schedule "cost" for chains, "off" for
  trees). At a width W given, dloop without a block_size whose S_max stages of
  the drafter's gamma W cannot verify whole drafts the loop W does (as at the
  profile's width; S_max, default 3, bounds its stages).
  """
  trees = is_int(tree_budget) and tree_budget > 0
  drafter_gamma = getattr(drafter, "block_size", None)
  if (is_int(fixed_width) and fixed_width > 0 and mode == "dloop" and block_size is None
      and drafter_gamma and not trees):
    stages = max_stages if max_stages is not None else profiles.DEFAULT_MAX_STAGES
    if is_int(stages) and stages > 0 and fixed_width < 1 + stages * drafter_gamma:
      block_size, max_stages = loop_shape_for_width(
          fixed_width, drafter_block_size=drafter_gamma, max_stages=stages)
  if fixed_width is None:
    free = not is_16_bit(target) or asks_free_widths(
        fixed_width=fixed_width, schedule=schedule, tree_budget=tree_budget)
    if free:
      fixed_width = 0
    else:
      width = profiles.resolve(profile).fixed_width
      if mode == "dloop" and block_size is None and max_stages is None and drafter_gamma:
        block_size, max_stages = loop_shape_for_width(
            width, drafter_block_size=drafter_gamma, max_stages=profiles.DEFAULT_MAX_STAGES)
      elif mode == "sd" and block_size is None and drafter_gamma:
        block_size = min(drafter_gamma, width - 1)
      gamma = block_size if block_size is not None else drafter_gamma
      stages = 1 if mode == "sd" else (
          max_stages if max_stages is not None else profiles.DEFAULT_MAX_STAGES)
      if is_int(gamma) and is_int(stages) and gamma > 0 and stages > 0:
        width = max(width, 1 + stages * gamma)
      fixed_width = width
  if block_size is None:
    block_size = drafter_gamma
  if max_stages is None:
    max_stages = profiles.DEFAULT_MAX_STAGES
  if mode == "sd":
    max_stages = 1
  if schedule is None:
    schedule = "off" if trees or fixed_width else "cost"
  return DecodingShape(block_size=block_size, max_stages=max_stages, schedule=schedule,
                       fixed_width=fixed_width)


def validate_exactness(*, target, mode, fixed_width, tree_budget, allow_inexact) -> None:
  """Refuses speculative decoding that would not reproduce `ar` bit for bit.

  Greedy outputs of `sd` / `dloop` equal `ar`'s with the same options. In f32
  that holds at any width up to the near-tie rule (a verification of T tokens
  rounds like T one-token steps to within ~1e-6). A 16-bit target rounds its
  activations to 8 significant bits in every product, so a forward of another
  width moves logits by up to ~1e-1 and flips argmaxes well away from ties:
  exact only when every forward has one width (`fixed_width`), which trees
  cannot use yet. An int8 target's XLA:CPU products quantize the activations
  per row, where a last-bit change moves a code by a whole step: the same rule.
  """
  if mode == "ar" or allow_inexact or not is_16_bit(target):
    return
  trees = is_int(tree_budget) and tree_budget > 0
  if trees:
    raise ConfigError(
        f"tree_budget={tree_budget} with a 16-bit target (weights {np.dtype(target.weight_dtype)},"
        f" compute {np.dtype(target.dtype)}) would not reproduce mode 'ar' exactly: trees verify"
        " at varying widths, where 16-bit products round differently. Use f32 weights"
        " (load_target(..., weights='f32'), python -m infer --weights f32), or chains"
        " (tree_budget=0) at a fixed width; allow_inexact=True (--allow-inexact) runs it anyway.")
  if not fixed_width:
    raise ConfigError(
        f"Free verification widths (fixed_width=0 or schedule='cost') with a 16-bit target"
        f" (weights {np.dtype(target.weight_dtype)}, compute {np.dtype(target.dtype)}) would not"
        " reproduce mode 'ar' exactly: 16-bit products round differently at each width. Leave"
        " fixed_width and schedule at their defaults (every forward at the profile's fixed"
        " width), or use f32 weights (weights='f32', --weights f32); allow_inexact=True"
        " (--allow-inexact) runs it anyway.")
