"""The flags every command that measures drafters takes: which drafters, on which target."""

from __future__ import annotations

import argparse

DEFAULT_TARGET = "smollm2-135m-instruct"


def add(parser: argparse.ArgumentParser) -> None:
  """--drafters (required) and --target."""
  parser.add_argument("--drafters", required=True,
                      help="comma-separated shipped drafter names, export directories or"
                           " workdirs")
  parser.add_argument("--target", default=DEFAULT_TARGET,
                      help="the target: registry name, .gguf or HF directory")
