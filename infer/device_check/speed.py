"""Speed on this device: inside the decode loop, next to isolated forwards; and prefill.

Inside the loop, the time of one `ar` step or one dloop round comes from two
runs of the same compiled program (`generate` with `long_tokens` and with
`short_tokens` new tokens, both in one cache-capacity bucket) as

    ms per iteration = (seconds(long) - seconds(short)) / (iterations(long) - iterations(short))

so that prefill and the call's fixed costs cancel. It is set against the
isolated costs `python -m infer.profile` measures: the target forward per
width (`decoding.costs.calibrate`, a half-full 512-slot cache like the
decode's) and a drafter's stage and commit (`infer.profile.measure`), whose
sum is the modeled round (`infer.profile.modeled.round_ms`). A ratio well
above 1 is time the loop spends outside the forwards.

Prefill: `generate(max_new_tokens=1)` of one prompt of each length, tokens per
second over the best of a few calls; a length past the context window is
skipped, and so is one the device runs out of memory for, saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dloop_jax.decoding import GenerationOutput, generate
from dloop_jax.decoding import costs as costs_lib
from infer.device_check.checks import run_plans
from infer.device_check.plans import Plan
from infer.profile import measure, modeled, presets


def iterations(out: GenerationOutput) -> int:
  """Iterations of the decode loop: the most rounds of any row (no drafting pauses here)."""
  return max(r.rounds for r in out.rows)


def best_of(run: Callable[[], GenerationOutput], *, repeats: int,
            first: GenerationOutput | None = None) -> GenerationOutput:
  """The fastest of `repeats` calls of `run` (`first`, an earlier call, counts as one)."""
  outs = [first] if first is not None else []
  while len(outs) < max(1, repeats):
    outs.append(run())
  return min(outs, key=lambda o: o.seconds)


def in_loop(run: Callable[[int], GenerationOutput], *, long_tokens: int, short_tokens: int,
            repeats: int, first: GenerationOutput | None = None) -> dict:
  """ms per loop iteration of `run(max_new_tokens)`, prefill cancelled (module docstring).

  Args:
    run: one generate call for a number of new tokens (same program for both).
    long_tokens, short_tokens: the two lengths.
    repeats: calls per length (the fastest counts).
    first: an earlier call of `run(long_tokens)` (the correctness run), reused.

  Returns:
    {"ms_per_iteration", "iterations", "seconds", "shared_program" (the short
    call compiled nothing), "ms_per_iteration_with_prefill" (the long call
    alone, for reference), "width" (tokens a target forward of the loop read:
    the first row's target tokens per iteration, from the runs' statistics)}.
  """
  long = best_of(lambda: run(long_tokens), repeats=repeats, first=first)
  shorts = [run(short_tokens)]
  shared = shorts[0].compile_seconds == 0.0
  short = best_of(lambda: run(short_tokens), repeats=repeats, first=shorts[0])
  n_long, n_short = iterations(long), iterations(short)
  ms = (1e3 * (long.seconds - short.seconds) / (n_long - n_short) if n_long > n_short
        else None)
  if ms is not None and ms <= 0:
    ms = None  # the calls' noise is larger than the iterations' time (tiny shapes)
  tokens = long.rows[0].target_tokens - short.rows[0].target_tokens
  steps = long.rows[0].rounds - short.rows[0].rounds
  width = tokens / steps if steps > 0 else None
  return dict(ms_per_iteration=ms, iterations=[n_long, n_short], width=width,
              seconds=[long.seconds, short.seconds], shared_program=shared,
              ms_per_iteration_with_prefill=1e3 * long.seconds / n_long if n_long else None,
              tokens_per_s=long.tokens_per_second)


def isolated(*, target, drafter, batch_size: int, block_size: int, max_stages: int,
             width: int, repeats: int) -> dict:
  """The isolated costs: target forward at widths 1 and `width`, a drafter stage and commit.

  Returns:
    {"table": CostTable, "drafter": {"stage_ms", "commit_ms", "params"},
    "round_ms": T(width) + S * stage + commit}.
  """
  table = costs_lib.calibrate(target, batch_size=batch_size, widths=[1, width], repeats=repeats)
  drafter_ms = measure.drafter_costs(drafter, target=target, block_size=block_size,
                                     batch_size=batch_size,
                                     capacity=min(costs_lib.CALIBRATION_CAPACITY,
                                                  target.config.max_position_embeddings),
                                     repeats=repeats)
  return dict(table=table, drafter=drafter_ms,
              round_ms=modeled.round_ms(table, drafter_ms, block_size=block_size,
                                        stages=max_stages))


def loop_speed(*, target, drafter, prompts: Sequence[Sequence[int]], plan: Plan,
               runs: dict[str, GenerationOutput]) -> dict:
  """In-loop ms per ar step (width 1 and the fixed width) and per dloop round at one batch size,
  with the isolated costs beside them.

  Args:
    target, drafter: the bf16 target and its drafter.
    prompts: the batch.
    plan: the preset's plan (shape, token counts, repeats).
    runs: the fixed-width correctness runs ("ar", "dloop") of these prompts,
      reused as long calls of the same programs.

  Returns:
    {"cost_ms": {width: ms}, "drafter": {"stage_ms", "commit_ms", "params"},
    and "ar", "ar_fixed", "dloop": `in_loop` with "isolated_ms" (T(1), T(W),
    the modeled round) and "ratio" (in-loop / isolated)}. "ar" runs at width 1
    (`fixed_width=0`: a 16-bit target's `ar` otherwise runs at the profile's
    fixed width, 16 on accelerators), as the T(1) it is set against.
  """
  shape = plan.shape
  iso = isolated(target=target, drafter=drafter, batch_size=len(prompts),
                 block_size=shape.block_size, max_stages=shape.max_stages, width=shape.width,
                 repeats=plan.repeats)
  fixed = run_plans(kind="fixed", shape=shape, drafter=drafter)
  table = iso["table"]
  out = dict(cost_ms={str(w): c for w, c in table.costs.items()}, drafter=iso["drafter"])
  for name, kwargs, first, isolated_ms in (
      ("ar", dict(mode="ar", fixed_width=0), None, table.costs[1]),
      ("ar_fixed", fixed["ar"], runs.get("ar"), table.costs[shape.width]),
      ("dloop", fixed["dloop"], runs.get("dloop"), iso["round_ms"])):
    e = in_loop(lambda n, kw=kwargs: generate(target, prompts, max_new_tokens=n, **kw),
                long_tokens=shape.long_tokens, short_tokens=plan.short_tokens,
                repeats=plan.repeats, first=first)
    e["isolated_ms"] = isolated_ms
    e["ratio"] = (e["ms_per_iteration"] / isolated_ms
                  if e["ms_per_iteration"] and isolated_ms else None)
    out[name] = e
  return out


def prefill(*, target, lengths: Sequence[int], repeats: int, log=lambda _: None,
            seed: int = 0) -> list[dict]:
  """Prefill tokens per second of one prompt of each length (batch 1).

  Returns one entry per length: {"length", "tokens_per_s", "seconds",
  "compile_seconds"} or {"length", "skipped": why}.
  """
  config = target.config
  rng = np.random.default_rng(seed)
  results = []
  for n in lengths:
    if n + 1 > config.max_position_embeddings:
      results.append(dict(length=n, skipped=f"past the context window of"
                                              f" {config.max_position_embeddings} tokens"))
      log(f"prefill {n}: skipped (context window {config.max_position_embeddings})")
      continue
    prompt = [rng.integers(0, config.vocab_size, n).tolist()]
    try:
      first = generate(target, prompt, max_new_tokens=1)
      out = best_of(lambda p=prompt: generate(target, p, max_new_tokens=1), repeats=repeats,
                    first=first)
    except Exception as e:  # pylint: disable=broad-except
      if not presets.is_out_of_memory(e):
        raise
      results.append(dict(length=n, skipped="out of device memory: "
                          + str(e).splitlines()[0][:300]))
      log(f"prefill {n}: skipped (out of device memory)")
      continue
    results.append(dict(length=n, tokens_per_s=n / out.seconds, seconds=out.seconds,
                        compile_seconds=first.compile_seconds))
    log(f"prefill {n}: {n / out.seconds:,.0f} tokens/s ({1e3 * out.seconds:.1f} ms; compile"
        f" {first.compile_seconds:.1f} s)")
  return results
