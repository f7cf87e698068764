"""The checks `generate()` runs on its arguments before anything is traced.

Every bad value is refused here with a `ConfigError` that names the argument
and what it accepts, instead of failing deep inside a trace.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.errors import ConfigError

MODES = ("ar", "sd", "dloop")


def is_int(value) -> bool:
  """An int or a numpy integer; not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate(*, mode, drafter, block_size, gate, max_stages, max_new_tokens, target,
             schedule, draft_backoff, tree_budget, confidence="auto") -> None:
  """Raises ConfigError, saying what to change, for arguments `generate()` cannot run."""
  if mode not in MODES:
    raise ConfigError(f"mode must be one of {MODES}, got {mode!r}.")
  if not is_int(tree_budget) or tree_budget < 0:
    raise ConfigError(f"tree_budget must be an int >= 0 (0 = chains), got {tree_budget!r}.")
  if tree_budget and mode == "ar":
    raise ConfigError("tree_budget > 0 needs mode 'sd' or 'dloop' (and a drafter).")
  if schedule not in schedule_lib.SCHEDULES:
    raise ConfigError(f"schedule must be one of {schedule_lib.SCHEDULES}, got {schedule!r}.")
  if confidence not in schedule_lib.CONFIDENCES:
    raise ConfigError(f"confidence must be one of {schedule_lib.CONFIDENCES}, got"
                      f" {confidence!r}.")
  if draft_backoff is not None and (not is_int(draft_backoff) or draft_backoff < 0):
    raise ConfigError(f"draft_backoff must be None or an int >= 0 (rounds), got {draft_backoff!r}.")
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
  if mode == "ar":
    return
  if drafter is None:
    raise ConfigError(f"mode {mode!r} needs a drafter (pass drafter=...), or use mode='ar'.")
  if not is_int(block_size) or block_size < 1:
    raise ConfigError(f"block_size (gamma) must be an int >= 1, got {block_size!r}.")
  limit = drafter.max_block_size()
  if limit is not None and block_size > limit:
    raise ConfigError(f"block_size {block_size} exceeds what drafter {drafter.name!r} can draft"
                      f" in one stage ({limit}).")
  if not is_int(max_stages) or max_stages < 1:
    raise ConfigError(f"max_stages (S_max) must be an int >= 1, got {max_stages!r}.")
  if (isinstance(gate, bool) or not isinstance(gate, (numbers.Real, np.floating, np.integer))
      or math.isnan(float(gate))):
    raise ConfigError(f"gate must be a number (-inf and +inf allowed), got {gate!r}.")
  drafter.check_target(target.config)
  if confidence == "drafter" and not drafter.has_confidence:
    raise ConfigError(f"confidence='drafter' needs a drafter with a learned confidence (DSpark's"
                      f" confidence head); drafter {drafter.name!r} has none: use"
                      " confidence='probability' (or 'auto').")
  validate_tree(drafter=drafter, tree_budget=tree_budget)


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
  if not is_int(fixed_width) or fixed_width < 0:
    raise ConfigError(f"fixed_width must be an int >= 0 (0 = each forward as wide as its"
                      f" tokens), got {fixed_width!r}.")
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
