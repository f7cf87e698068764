"""Correctness on this device: greedy outputs of every mode against `ar`, and a sampling run.

Four greedy comparisons (docs/design.md §The near-tie rule), each at every batch size but
the int8 one (the first):

  fixed-width bf16   bf16 weights and compute, every target forward W tokens
                     wide (`generate(fixed_width=W)`): sd and dloop must equal
                     ar bit for bit (the one exact comparison with 16-bit
                     weights);
  fixed-width int8   the same with int8 weight matrices in the accelerator
                     profiles' weight-only form (`quantized`): equal to ar of
                     the same int8 model, bit for bit;
  free-width f32     f32 weights at the widths each round needs (sd with
                     drafting pauses, dloop through the `lax.switch` over its
                     verification widths): equal to ar, or first
                     different where the target's top-2 logit gap is a
                     near-tie (`decoding.lossless`);
  tree f32           dloop verifying a draft tree (`tree_budget`), same rule.

Every run's statistics are checked too (`stats_problems`). The sampling smoke
test runs dloop at temperature 1 and checks what can be checked of a random
output: it runs, its tokens are in the vocabulary, its statistics add up.

Drafters have random weights: their drafts are nearly all rejected (the
accepted-draft paths are tested on the CPU by the test suite with drafters
built from the target); what a device can get wrong is the numbers and the
programs, which these runs exercise at every verification width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dloop_jax.decoding import GenerationOutput, SamplingConfig, generate
from dloop_jax.decoding import lossless
from infer.device_check.plans import Shape

# A gate no stage misses: every dloop round drafts S_max stages.
ALWAYS = -1e9


def prompts(*, batch_size: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
  """Random prompts; the first has `length` tokens, the others between length // 2 and length."""
  rng = np.random.default_rng(seed)
  lengths = [length] + rng.integers(max(1, length // 2), length + 1, batch_size - 1).tolist()
  return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def compare_outputs(*, reference: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                    prompts: Sequence[Sequence[int]], target=None, exact: bool) -> dict:
  """Compares the rows of `got` with the reference (ar) rows.

  Args:
    reference: the ar output's tokens per row.
    got: the tokens per row of the run checked.
    prompts: the prompts of the rows.
    target: the target of both runs; where a row differs, its top-2 logit gap
      at the first difference is measured (None: not measured).
    exact: True: every row must be identical; False: identical, or first
      different at a near-tie of the target (`decoding.lossless`).

  Returns:
    {"ok", "identical_rows", "rows", "mismatches": [{"row", "first_difference",
    "top2_gap", "tolerance", "near_tie", "expected", "got"}]} (the token lists
    cut a few tokens past the difference).
  """
  if len(reference) != len(got):
    return dict(ok=False, identical_rows=0, rows=len(reference),
                mismatches=[dict(row=None, problem=f"{len(got)} rows against {len(reference)}")])
  mismatches = []
  for i, (want, have) in enumerate(zip(reference, got)):
    first = lossless.first_difference(want, have)
    if first is None:
      continue
    gap, tolerance = None, None
    if target is not None:
      c = lossless.compare(target, prompts[i], want, have)
      gap, tolerance = c.top2_gap, c.tolerance
    near = gap is not None and gap < tolerance
    mismatches.append(dict(row=i, first_difference=first, top2_gap=gap, tolerance=tolerance,
                           near_tie=near, expected=list(want[:first + 4]),
                           got=list(have[:first + 4])))
  ok = not mismatches if exact else all(m["near_tie"] for m in mismatches)
  return dict(ok=ok, identical_rows=len(reference) - len(mismatches), rows=len(reference),
              mismatches=mismatches)


def stats_problems(out: GenerationOutput, *, max_new_tokens: int, vocab_size: int,
                   fixed_width: int = 0) -> list[str]:
  """What does not add up in a run without stop tokens (empty: all consistent)."""
  problems = []
  for i, (tokens, r) in enumerate(zip(out.tokens, out.rows)):
    where = f"row {i}"
    if len(tokens) != r.new_tokens or r.new_tokens != max_new_tokens:
      problems.append(f"{where}: {len(tokens)} tokens, new_tokens {r.new_tokens}, asked for"
                      f" {max_new_tokens}")
    if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
      problems.append(f"{where}: token ids {min(tokens)}..{max(tokens)} outside [0, {vocab_size})")
    if r.committed_in_rounds != r.new_tokens - 1:
      problems.append(f"{where}: {r.committed_in_rounds} tokens committed by rounds, expected"
                      f" new_tokens - 1 = {r.new_tokens - 1}")
    if not 0 <= r.accepted <= r.verified <= r.drafted:
      problems.append(f"{where}: accepted {r.accepted}, verified {r.verified}, drafted"
                      f" {r.drafted} (need accepted <= verified <= drafted)")
    if r.rounds < 1 or r.rounds > max_new_tokens - 1:
      problems.append(f"{where}: {r.rounds} rounds for {max_new_tokens} tokens")
    if out.mode != "ar":
      if sum(r.stage_histogram) != r.rounds:
        problems.append(f"{where}: stage histogram {r.stage_histogram} sums to"
                        f" {sum(r.stage_histogram)}, not the {r.rounds} rounds")
      if r.committed_in_rounds > r.rounds + r.accepted:
        problems.append(f"{where}: {r.committed_in_rounds} committed > rounds + accepted")
    if fixed_width and r.target_tokens != fixed_width * r.rounds:
      problems.append(f"{where}: target read {r.target_tokens} tokens in {r.rounds} rounds at"
                      f" fixed width {fixed_width}")
  return problems


def run_summary(out: GenerationOutput) -> dict:
  """What a run reports: mode, time, and its statistics summed over rows."""
  t = out.total
  return dict(mode=out.mode, seconds=out.seconds, compile_seconds=out.compile_seconds,
              rounds=t.rounds, loop_iterations=max(r.rounds for r in out.rows),
              new_tokens=t.new_tokens, drafted=t.drafted, verified=t.verified,
              accepted=t.accepted, plain_rounds=t.plain_rounds,
              stage_histogram=t.stage_histogram, acceptance_length=t.acceptance_length)


def run_plans(*, kind: str, shape: Shape, drafter) -> dict[str, dict]:
  """The `generate` arguments (all but the prompts and the token count) of one comparison's
  runs, {name: kwargs}, the reference ("ar") first.

  kind:
    "fixed"  ar, sd, dloop at fixed width `shape.width`;
    "free"   ar; sd verifying every draft, with drafting pauses after rejected
             rounds (plain steps between verifications); dloop drafting every
             stage, its verification one branch of a switch over the widths
             of 1..S_max stages;
    "tree"   ar, dloop with a draft tree of `shape.tree_budget` nodes per stage.
  """
  g, s = shape.block_size, shape.max_stages
  # The drafter's own stages (the prompt lookup would end a row's round after its first).
  spec = dict(drafter=drafter, block_size=g, lookup="off")
  if kind == "fixed":
    w = dict(fixed_width=shape.width)
    return {"ar": dict(mode="ar", **w),
            "sd": dict(mode="sd", schedule="off", draft_backoff=0, **spec, **w),
            "dloop": dict(mode="dloop", gate=ALWAYS, max_stages=s, schedule="off",
                          draft_backoff=0, **spec, **w)}
  if kind == "free":
    return {"ar": dict(mode="ar"),
            "sd": dict(mode="sd", schedule="off", draft_backoff=4, **spec),
            "dloop": dict(mode="dloop", gate=ALWAYS, max_stages=s, schedule="off",
                          draft_backoff=0, **spec)}
  if kind == "tree":
    return {"ar": dict(mode="ar"),
            f"dloop/tree{shape.tree_budget}": dict(
                mode="dloop", gate=ALWAYS, max_stages=s, tree_budget=shape.tree_budget,
                schedule="off", draft_backoff=0, **spec)}
  raise ValueError(f"unknown comparison kind {kind!r}")


def greedy_runs(*, target, drafter, prompts: Sequence[Sequence[int]], shape: Shape,
                kind: str, max_new_tokens: int | None = None) -> dict[str, GenerationOutput]:
  """The runs of one comparison (`run_plans`), {name: output}: `max_new_tokens` new tokens
  per row, by default `shape.long_tokens` at the fixed width (the speed section times these
  programs), else `shape.new_tokens`."""
  n = max_new_tokens or (shape.long_tokens if kind == "fixed" else shape.new_tokens)
  return {name: generate(target, prompts, max_new_tokens=n, **kw)
          for name, kw in run_plans(kind=kind, shape=shape, drafter=drafter).items()}


def compare_runs(runs: dict[str, GenerationOutput], *, target, prompts, exact: bool,
                 max_new_tokens: int, fixed_width: int = 0) -> dict:
  """Every run against the first ("ar"): token comparison and statistics."""
  names = list(runs)
  reference = runs[names[0]]
  result = dict(ok=True, exact=exact, runs={})
  for name in names:
    out = runs[name]
    entry = run_summary(out)
    entry["stats_problems"] = stats_problems(out, max_new_tokens=max_new_tokens,
                                             vocab_size=target.config.vocab_size,
                                             fixed_width=fixed_width)
    ok = not entry["stats_problems"]
    if name != names[0]:
      entry["comparison"] = compare_outputs(reference=reference.tokens, got=out.tokens,
                                            prompts=prompts, target=target, exact=exact)
      ok = ok and entry["comparison"]["ok"]
    entry["ok"] = ok
    result["runs"][name] = entry
    result["ok"] = result["ok"] and ok
  return result


def sampling_smoke(*, target, drafter, prompts: Sequence[Sequence[int]], shape: Shape,
                   seed: int = 0) -> dict:
  """dloop at temperature 1 (fixed width): it runs, tokens in range, statistics consistent."""
  out = generate(target, prompts, max_new_tokens=shape.new_tokens, mode="dloop",
                 drafter=drafter, block_size=shape.block_size, gate=ALWAYS,
                 max_stages=shape.max_stages, sampling=SamplingConfig(temperature=1.0),
                 seed=seed, fixed_width=shape.width, schedule="off", draft_backoff=0)
  problems = stats_problems(out, max_new_tokens=shape.new_tokens,
                            vocab_size=target.config.vocab_size, fixed_width=shape.width)
  distinct = len({t for row in out.tokens for t in row})
  if shape.new_tokens * len(prompts) >= 16 and distinct < 2:
    problems.append(f"all {shape.new_tokens * len(prompts)} sampled tokens are the same id")
  return dict(ok=not problems, problems=problems, distinct_tokens=distinct,
              batch_size=len(prompts), **run_summary(out))


def error_record(e: Exception) -> dict:
  """A check that raised `e`: {"ok": False, "error": its type and first line}."""
  text = str(e).splitlines()[0][:500] if str(e) else ""
  return dict(ok=False, error=f"{type(e).__name__}: {text}" if text else type(e).__name__)


def guarded(fn: Callable[[], dict]) -> dict:
  """`fn()`, or `error_record` of what it raised (the check fails, the rest goes on)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    return error_record(e)
