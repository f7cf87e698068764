"""Timing of a drafter's stage and commit, and of a whole DLoop generation.

The target's per-width forward cost is `decoding.costs.calibrate` (the same
measurement and table the scheduler reads); this module times the rest of a
round: one drafting stage of gamma tokens and the commit of a verified round
(1 + gamma positions of target features), per drafter kind, and the rounds
per second of `generate(mode="dloop")` with every stage drafted and verified.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.decoding import generate
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters import build_drafter

# A gate no stage misses: every round drafts S_max stages and verifies
# 1 + S_max * gamma tokens, the round the modeled table prices.
ALWAYS = -1e9


def median_ms(fn: Callable[[], object], *, repeats: int) -> float:
  """Median wall time of `fn()` in ms (blocked on its result), after one untimed call."""
  jax.block_until_ready(fn())  # compile, and one cold run
  times = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


@functools.partial(jax.jit, static_argnums=(0,))
def _commit(graph, params, state, tokens, features, next_tokens, starts, counts):
  drafter = nnx.merge(graph, params)
  return drafter.commit(state, tokens=tokens, features=features, next_tokens=next_tokens,
                        starts=starts, counts=counts)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _stage(graph, params, state, block_size, key):
  drafter = nnx.merge(graph, params)
  state, stage = drafter.draft_stage(state, key=key, block_size=block_size,
                                     sampling=sampling_lib.GREEDY)
  return state, stage.tokens, stage.logprobs


def random_drafter(kind: str, *, target, block_size: int, seed: int = 0):
  """A random-weight drafter of `kind` (default config for `target`) drafting `block_size`."""
  return build_drafter(dict(kind=kind, block_size=block_size), target=target,
                       rngs=nnx.Rngs(seed))


def drafter_costs(drafter, *, target, block_size: int, batch_size: int, capacity: int,
                  repeats: int, seed: int = 0) -> dict:
  """Times one drafting stage and one commit of a verified round.

  The commit ingests 1 + gamma positions of target features (a round whose
  drafts were all accepted) at a half-full drafter cache; the stage drafts
  gamma tokens after them, greedily.

  Returns:
    {"stage_ms", "commit_ms", "params"} (params: the drafter's own weights,
    shared target weights excluded).
  """
  c = target.config
  graph, params = nnx.split(drafter)
  rng = np.random.default_rng(seed)
  width = 1 + block_size
  start = capacity // 2
  tokens = jnp.asarray(rng.integers(0, c.vocab_size, (batch_size, width)), jnp.int32)
  next_tokens = jnp.asarray(rng.integers(0, c.vocab_size, (batch_size, width)), jnp.int32)
  features = jnp.asarray(rng.standard_normal((batch_size, width, len(drafter.taps),
                                              c.hidden_size)), target.dtype)
  starts = jnp.full((batch_size,), start, jnp.int32)
  counts = jnp.full((batch_size,), width, jnp.int32)
  empty = drafter.init_state(batch_size=batch_size, capacity=capacity)

  def commit():
    return _commit(graph, params, empty, tokens, features, next_tokens, starts, counts)

  commit_ms = median_ms(commit, repeats=repeats)
  state = commit()
  key = jax.random.key(seed)
  stage_ms = median_ms(lambda: _stage(graph, params, state, block_size, key), repeats=repeats)
  own = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
  return dict(stage_ms=stage_ms, commit_ms=commit_ms, params=own)


def generation_rate(target, drafter, *, block_size: int, max_stages: int, batch_size: int,
                    prompt_length: int, max_new_tokens: int, costs, seed: int = 0) -> dict:
  """Rounds per second of a whole `generate(mode="dloop")` call.

  Every round drafts `max_stages` stages (a gate no stage misses) and verifies
  all drafts (schedule "off", no drafting back-off): with random weights the
  drafts are rejected, so each round commits one token and the rate is of
  full-width rounds. The time includes the prompt's prefill.
  """
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, target.config.vocab_size, (batch_size, prompt_length)).tolist()
  out = generate(target, prompts, max_new_tokens=max_new_tokens, mode="dloop", drafter=drafter,
                 block_size=block_size, gate=ALWAYS, max_stages=max_stages, schedule="off",
                 draft_backoff=0, costs=costs)
  rounds = max(r.rounds for r in out.rows)
  return dict(rounds=rounds, seconds=out.seconds, compile_seconds=out.compile_seconds,
              rounds_per_s=rounds / out.seconds if out.seconds > 0 else 0.0,
              ms_per_round=1e3 * out.seconds / rounds if rounds else 0.0,
              tokens_per_s=out.tokens_per_second, width=1 + max_stages * block_size,
              batch_size=batch_size, prompt_length=prompt_length,
              max_new_tokens=max_new_tokens, max_stages=max_stages, block_size=block_size)
