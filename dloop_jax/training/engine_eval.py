"""The drafter measured by the engine while it trains: τ of greedy `generate()`.

The trainer's `expected_acceptance_length` is an estimate from teacher-forced
accuracies on training batches. What a drafter is for is the acceptance length
the engine gets from it on prompts it never saw, drafting from its own
earlier drafts (and, in `dloop`, from its own earlier stages). `EngineEval`
measures that every `eval.every_steps`: greedy generation over held-out
prompts with every draft verified (`schedule="off"`, so τ is the drafter's, not
the scheduler's), in each of `eval.modes`, reported as `engine_tau_<mode>`.
The trainer exports the best step by `eval.keep_best` to `<workdir>/best`.

The first evaluation compiles the decode programs; later ones reuse them (the
drafter's structure does not change, only its weights).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from dloop_jax.decoding.config import DecodingConfig, check
from dloop_jax.errors import ConfigError

# How the evaluation decodes, where it differs from `generate()`'s defaults:
# every draft verified (τ is the drafter's, not the scheduler's), no
# prompt-lookup drafts, forwards as wide as their tokens, and a 16-bit target
# allowed there (τ only: its tokens need not reproduce ar's).
EVAL_DECODING = DecodingConfig(schedule="off", lookup="off", fixed_width=0, allow_inexact=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineEval:
  """Held-out prompts and how to generate from them.

  Attributes:
    prompts: token ids per prompt (chat template applied).
    stop_tokens: generation stops at these (the tokenizer's end of turn).
    max_new_tokens: new tokens per prompt.
    modes: "sd" and / or "dloop".
    decoding: the options of every mode (its `mode` is each of `modes`);
      `block_size` and `max_stages` shape dloop's loop only (`sd` drafts
      one stage of the drafter's gamma). schedule="cost" and lookup="prompt"
      measure the τ users get instead of the drafter's.
  """

  prompts: tuple[tuple[int, ...], ...]
  stop_tokens: tuple[int, ...] = ()
  max_new_tokens: int = 64
  modes: tuple[str, ...] = ("sd", "dloop")
  decoding: DecodingConfig = EVAL_DECODING

  def config(self, mode: str) -> DecodingConfig:
    """The decoding config of `mode`."""
    if mode == "dloop":
      return self.decoding.replace(mode=mode)
    return self.decoding.replace(mode=mode, block_size=None, max_stages=None)

  def __call__(self, target: Any, drafter: Any) -> dict[str, float]:
    """τ per mode, dloop's multi-stage share and the seconds, for `drafter` on `target`.

    Returns:
      {"engine_tau_<mode>": τ for each mode, "engine_multi_stage_dloop": the
      share of dloop's rounds that drafted more than one stage (with dloop),
      "engine_eval_s": seconds}.
    """
    from dloop_jax.decoding import generate  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    out: dict[str, float] = {}
    for mode in self.modes:
      result = generate(target, [list(p) for p in self.prompts], max_new_tokens=self.max_new_tokens,
                        drafter=drafter, config=self.config(mode), stop_tokens=self.stop_tokens)
      total = result.total
      out[f"engine_tau_{mode}"] = float(total.acceptance_length)
      if mode == "dloop":
        out["engine_multi_stage_dloop"] = sum(total.stage_histogram[2:]) / max(total.rounds, 1)
    out["engine_eval_s"] = time.perf_counter() - start
    return out


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
  return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True))


def fitting_prompts(tokenizer: Any, candidates: Iterable[tuple[str, str]], *, per_group: int,
                    limit: int, skip: int = 0) -> list[tuple[int, ...]]:
  """Chat-template token ids of the first `per_group` (group, text) candidates of each group
  that fit `limit` tokens, after each group's first `skip` candidates."""
  prompts, seen, taken = [], {}, {}
  for group, text in candidates:
    seen[group] = seen.get(group, 0) + 1
    if seen[group] <= skip or taken.get(group, 0) >= per_group:
      continue
    ids = _chat_ids(tokenizer, text)
    if len(ids) <= limit:
      prompts.append(tuple(ids))
      taken[group] = taken.get(group, 0) + 1
  return prompts


def _candidates(source: str, *, num_prompts: int, data_dir: str) -> list[tuple[str, str]]:
  """(group, text) pairs: "bench" groups by category, a file is one group."""
  if source == "bench":
    from dloop_jax.data import bench_prompts  # pylint: disable=g-import-not-at-top
    rows = bench_prompts.load(bench_prompts.CATEGORIES, per_category=num_prompts,
                              data_dir=data_dir or None)
    return [(row.category, row.text) for row in rows]
  from dloop_jax import prompt_files  # pylint: disable=g-import-not-at-top
  return [("file", text) for text in prompt_files.read_prompts(source)]


def from_config(eval_config: Mapping[str, Any], *, target: Any, tokenizer: Any,
                seed: int = 0) -> EngineEval:
  """The evaluation `eval_config` (the trainer's `eval` section) describes.

  Args:
    eval_config: `prompts`, `num_prompts`, `max_prompt_tokens`,
      `max_new_tokens`, `modes`, `data_dir` and `decoding` (fields of
      `DecodingConfig` that override `EVAL_DECODING`'s).
    target: the target `Transformer` (its context length bounds the prompts).
    tokenizer: the target's tokenizer (None for tiny targets: "random" only).
    seed: "random" prompts' seed.

  Raises:
    ConfigError: a prompt source the target cannot use, or no prompt fits.
  """
  e = eval_config
  source, n = str(e["prompts"]), int(e["num_prompts"])
  limit = min(int(e["max_prompt_tokens"]),
              int(target.config.max_position_embeddings) - int(e["max_new_tokens"]))
  if source == "random":
    rng = np.random.default_rng(seed + 7919)  # not the training prompts' stream
    vocab = int(target.config.vocab_size)
    prompts = [tuple(int(t) for t in rng.integers(0, vocab, size=int(rng.integers(4, 17))))
               for _ in range(n)]
    stops: tuple[int, ...] = ()
  else:
    if tokenizer is None:
      raise ConfigError(f"eval.prompts={source!r} needs the target's tokenizer, and this target"
                        " has none; use eval.prompts='random'.")
    # The first `num_prompts` per group that fit (a file: its first ones).
    prompts = fitting_prompts(
        tokenizer, _candidates(source, num_prompts=n, data_dir=str(e["data_dir"])),
        per_group=n, limit=limit)
    stops = tuple(int(t) for t in getattr(tokenizer, "stop_token_ids", ()) or ())
  if not prompts:
    raise ConfigError(f"No eval prompt from {source!r} fits {limit} tokens (eval.max_prompt_tokens"
                      " and the target's context); raise the limit or use other prompts.")
  return EngineEval(prompts=tuple(prompts), stop_tokens=stops,
                    max_new_tokens=int(e["max_new_tokens"]), modes=tuple(e["modes"]),
                    decoding=decoding(e.get("decoding") or {}))


def decoding(overrides: Mapping[str, Any]) -> DecodingConfig:
  """`EVAL_DECODING` with `overrides` (the trainer's `eval.decoding`), checked.

  Raises:
    ConfigError: a field `DecodingConfig` does not have, or a value it refuses.
  """
  try:
    config = EVAL_DECODING.replace(**dict(overrides))
    for mode in ("sd", "dloop"):
      check(config.replace(mode=mode))
  except ConfigError as e:
    raise ConfigError(f"eval.decoding: {e}") from e
  return config
