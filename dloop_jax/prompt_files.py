"""Prompt files: JSONL with a "prompt" field per line (`python -m infer --prompts-file`,
the trainer's engine evaluation)."""

from __future__ import annotations

import json
import os

from dloop_jax.errors import DLoopError


def read_prompts(path: str | os.PathLike) -> list[str]:
  """The "prompt" field of every non-blank line of a JSONL file.

  Raises:
    DLoopError: a line is not a JSON object with a string "prompt" (names the
      file and the 1-based line number).
  """
  prompts = []
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DLoopError(f"{path}, line {number}: not valid JSON ({e.msg} at column {e.colno});"
                         ' each line must be an object like {"prompt": "..."}.') from e
      if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        got = (f"keys {sorted(record)}" if isinstance(record, dict)
               else f"a JSON {type(record).__name__}")
        raise DLoopError(f'{path}, line {number}: expected an object with a string "prompt"'
                         f" field, got {got}.")
      prompts.append(record["prompt"])
  return prompts
