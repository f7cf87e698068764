"""Command-line flags of `DecodingConfig`'s fields, shared by every command that decodes.

    parser = argparse.ArgumentParser()
    flags.add(parser, ("gate", "max_stages", "lookup"))
    args = parser.parse_args(argv)
    config = flags.config(args, mode="dloop")     # DecodingConfig(mode="dloop", + the flags given)

A flag is named after its field (`--max-stages` sets `max_stages`) and takes
None as its argparse default: a flag left out leaves the field to the config
it is applied to, so a default is written once, on `DecodingConfig` (or on the
config a command starts from, such as the trainer's evaluation), never in a
parser. The help text names that default, read from the config itself.

`--temperature`, `--top-p` and `--top-k` set `sampling` (a `SamplingConfig`).
The library has no command of its own; this module is here because the
inference, benchmark and training commands all read these flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from dloop_jax import profiles
from dloop_jax.decoding import arguments
from dloop_jax.decoding import config as config_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding.config import DecodingConfig
from dloop_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Flag:
  """One flag: what it parses and what it means (its default comes from the config)."""

  type: Any
  help: str
  choices: tuple[str, ...] | None = None


# The flags of the fields a command line can set, in the order --help lists them.
# `costs` takes a JSON file or "calibrate"; `sampling` is set through SAMPLING_FLAGS.
FLAGS: dict[str, Flag] = {
    "mode": Flag(str, "ar, sd or dloop", arguments.MODES),
    "block_size": Flag(int, "gamma: drafts per stage (default: the drafter's; dloop at a fixed"
                            " width: what the width verifies whole, 2 at width 5)"),
    "gate": Flag(arguments.parse_gate, "DLoop's confidence gate: a number g (draft another"
                                       " stage while the stage's summed log-probability is"
                                       " at least g), or auto (while the drafter's"
                                       " calibration says another stage pays for its cost"
                                       " here)"),
    "max_stages": Flag(int, "S_max: stages per verification (default:"
                            f" {profiles.DEFAULT_MAX_STAGES}; dloop at a fixed width: what the"
                            " width verifies whole, 2 at width 5)"),
    "schedule": Flag(str, "cost: verify only the prefix of the drafts expected to pay for its"
                          " verification (per-width cost table of this target on this machine;"
                          " with trees: the best nodes by path score); off: verify every draft"
                          " (default: cost at free widths, off at a fixed width and for trees)",
                     schedule_lib.SCHEDULES),
    "confidence": Flag(str, "c_k of the cost schedule: the drafter's learned confidence"
                            " (DSpark's confidence head), its top draft probability, or auto"
                            " (the learned one when the drafter has it)",
                       schedule_lib.CONFIDENCES),
    "tree_budget": Flag(int, "B > 0: draft a tree of the B best prefixes per stage (block"
                             " drafter: DDTree; EAGLE-3: dynamic tree) and verify it in one"
                             " target forward; 0: chains"),
    "fixed_width": Flag(int, "W > 0: every target forward after prefill W tokens wide (decode"
                             " steps padded, every draft verified; W >= 1 + S_max * gamma):"
                             " every mode's greedy output then equals ar's at the same W bit for"
                             " bit, 16-bit weights included (docs/decoding.md); 0: each forward"
                             " as wide as its tokens (default: the profile's width, cpu 5,"
                             " gpu / tpu 16, with 16-bit weights and chains, else 0)"),
    "draft_backoff": Flag(int, "longest pause (rounds) of drafting after fruitless rounds"
                               f" (default: {config_lib.DEFAULT_DRAFT_BACKOFF} with schedule"
                               " cost, else 0)"),
    "costs": Flag(str, "JSON cost table to schedule with, or 'calibrate' (measure this"
                       " target's table now if none is cached). Default: $DLOOP_COSTS, else the"
                       " table python -m infer.costs cached for the target, else the"
                       " profile's default table"),
    "calibration": Flag(str, "gate auto's calibration table: a JSON file written by python -m"
                             " train.calibrate (default: the one the drafter's export holds)"),
    "width_tolerance": Flag(float, "with the cost schedule, a width whose forward costs within"
                                   " this fraction of a wider one's is not compiled (0: every"
                                   " width)"),
    "lookup": Flag(str, "prompt: where a row's newest tokens occurred earlier in its prompt or"
                        " answer and the drafter is unsure of its first draft, verify the"
                        " tokens that followed them instead of the drafter's drafts (greedy"
                        " chains in sd / dloop; docs/decoding.md); auto: prompt where it"
                        " applies, off elsewhere", lookup_lib.CHOICES),
    "lookup_min_match": Flag(int, "the shortest matched suffix (tokens) the lookup uses"),
    "lookup_max_probability": Flag(float, "the lookup replaces drafts whose first one the"
                                          " drafter gives a probability below this"),
    "profile": Flag(str, "the hardware defaults (weights, dtype, forward width; default: this"
                         " backend's); every profile runs on every backend (docs/decoding.md)",
                    profiles.PROFILES),
    "allow_inexact": Flag(bool, "run 16-bit weights at free widths (trees, schedule cost),"
                                " whose greedy output equals ar's only up to 16-bit rounding"),
}

# Flags that set `sampling`: flag field -> SamplingConfig field.
SAMPLING_FLAGS: dict[str, Flag] = {
    "temperature": Flag(float, "sampling temperature (0: greedy)"),
    "top_p": Flag(float, "keep the smallest set of tokens whose probability reaches top-p"),
    "top_k": Flag(int, "keep the k most likely tokens (0: no limit)"),
}


def _default_text(value: Any) -> str:
  return "" if value is None else f" (default: {value})"


def add(parser: argparse.ArgumentParser, fields: Iterable[str], *, sampling: bool = False,
        base: DecodingConfig | None = None, help: Mapping[str, str] | None = None) -> None:
  """Adds a flag per field of `fields` (and the sampling flags), each with default None.

  Args:
    parser: the command's parser (or an argument group).
    fields: `DecodingConfig` field names among `FLAGS`.
    sampling: also add --temperature, --top-p and --top-k.
    base: the config the command applies the flags to; its values are the
      defaults --help names (None: `DecodingConfig()`).
    help: field -> help text replacing `FLAGS`' (the command's own wording,
      which then names the default itself).
  """
  # pylint: disable=redefined-builtin
  base = base if base is not None else DecodingConfig()
  help = dict(help or {})
  unknown = sorted(set(fields) - set(FLAGS)) + sorted(set(help) - set(FLAGS) - set(
      SAMPLING_FLAGS))
  if unknown:
    raise ValueError(f"No decoding flag for {unknown}; flags: {sorted(FLAGS)}.")
  for field in fields:
    _add_one(parser, field, FLAGS[field], getattr(base, field), help.get(field))
  if sampling:
    for field, flag in SAMPLING_FLAGS.items():
      _add_one(parser, field, flag, getattr(base.sampling, field), help.get(field))


def _add_one(parser, field: str, flag: Flag, default: Any, text: str | None) -> None:
  name = "--" + field.replace("_", "-")
  text = text if text is not None else flag.help + _default_text(default)
  if flag.type is bool:
    parser.add_argument(name, dest=field, action="store_true", default=None, help=text)
  else:
    parser.add_argument(name, dest=field, type=flag.type, choices=flag.choices, default=None,
                        help=text)


def given(args: argparse.Namespace) -> dict[str, Any]:
  """{field: value} of the decoding flags given on the command line (`sampling` apart)."""
  return {k: getattr(args, k) for k in FLAGS if getattr(args, k, None) is not None}


def config(args: argparse.Namespace, *, base: DecodingConfig | None = None,
           **fixed: Any) -> DecodingConfig:
  """`base` (None: `DecodingConfig()`) with the flags given, then `fixed`'s fields, applied."""
  base = base if base is not None else DecodingConfig()
  changes = given(args)
  sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}
  if sampling:
    changes["sampling"] = dataclasses.replace(base.sampling, **sampling)
  changes.update(fixed)
  return base.replace(**changes)


def check(config: DecodingConfig) -> None:
  """`config.check`, its ConfigError naming the command-line flags rather than the fields."""
  try:
    config_lib.check(config)
  except ConfigError as e:
    raise ConfigError(as_flags(str(e))) from None


def as_flags(message: str) -> str:
  """`message` with the decoding fields it names written as their flags (--max-stages)."""
  names = "|".join(sorted(FLAGS, key=len, reverse=True))
  return re.sub(rf"(?<![\w-])({names})(?![\w])",
                lambda m: "--" + m.group(1).replace("_", "-"), message)


def sampling_config(args: argparse.Namespace) -> sampling_lib.SamplingConfig:
  """The `SamplingConfig` of the sampling flags given (greedy where none is)."""
  return config(args).sampling
