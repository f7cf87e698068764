"""The plan of one `generate()` call: what its program is compiled for, and its inputs.

    plan, inputs = plan_lib.make(target, prompts, config=config, max_new_tokens=64,
                                 drafter=drafter)

`make` resolves the config once (`config.resolve`) and turns it, with the
prompts' shapes, into

  Plan    the static choices, hashable: the compile key of the decode program
          (model graphs, shapes, S_max, gamma, widths, sampling, lookup, ...).
  Inputs  the traced arrays: prompts, limits, stop tokens, the PRNG key, the
          gate, the cost table, the back-off and the confidence source.
          Changing one of them never recompiles.

After resolution "sd" is DLoop with S_max = 1: one drafting stage, no gate. A
plan knows only "ar" (no drafter) and speculative decoding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax.decoding import arguments
from dloop_jax.decoding import config as config_lib
from dloop_jax.decoding import costs as costs_lib
from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import tree_round
from dloop_jax.decoding.config import DecodingConfig
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.errors import ConfigError, PromptTooLongError
from dloop_jax.models import sharding as sharding_lib
from dloop_jax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the compiled program depends on besides array values.

  Attributes:
    speculative: drafts and verifies (config modes "sd" and "dloop"); False: "ar".
    block_size: gamma, drafts per stage (0 for "ar").
    max_stages: S_max (1 for "ar" and "sd").
    tree_budget: nodes per stage of a draft tree; 0: chains (`decoding.tree_round`).
    fixed_width: every target forward after prefill has this width (0: as needed).
    choosable: the widths the cost table leaves worth compiling
      (`schedule.choosable_widths`); empty: every candidate width.
    lookup: prompt lookup in the first stage (`decoding.lookup`), with its
      rule's shortest match and the drafter's first-draft probability below
      which it fires (0 without the lookup).
  """

  target_graph: Any
  drafter_graph: Any
  speculative: bool
  block_size: int
  max_stages: int
  schedule: str
  sampling: sampling_lib.SamplingConfig
  stop_slots: int  # length of the traced stop-token array (padded with -1)
  capture_taps: tuple[int, ...]
  batch_size: int
  prompt_width: int
  capacity: int
  tree_budget: int = 0
  grow_cache: bool = False  # "ar" only: the cache grows in steps (`cache_ladder`)
  fixed_width: int = 0
  choosable: tuple[int, ...] = ()
  lookup: bool = False
  lookup_min_match: int = 0
  lookup_max_probability: float = 0.0

  @property
  def loops(self) -> bool:
    """Whether a round may draft more than one stage (DLoop's gate decides)."""
    return self.max_stages > 1

  @property
  def draft_width(self) -> int:
    return self.max_stages * self.block_size if self.speculative else 0

  @property
  def verify_width(self) -> int:
    return max(1 + self.draft_width, self.fixed_width)

  @property
  def step_width(self) -> int:
    """Tokens a plain decode step's forward reads."""
    return self.fixed_width or 1

  @property
  def widths(self) -> tuple[int, ...]:
    """The compiled verification widths."""
    if self.choosable:
      return self.choosable
    return self.candidate_widths

  @property
  def candidate_widths(self) -> tuple[int, ...]:
    """The widths a round of this shape may verify, before the cost table prunes them."""
    if not self.speculative:
      return (1,)
    if self.fixed_width:
      return (self.fixed_width,)
    if not self.tree_budget:
      return schedule_lib.verify_widths(block_size=self.block_size, max_stages=self.max_stages,
                                        schedule=self.schedule)
    nodes = tree_round.max_nodes(budget=self.tree_budget, block_size=self.block_size,
                                 max_stages=self.max_stages)
    widths = schedule_lib.widths_for_drafts(nodes, schedule=self.schedule)
    if self.schedule == "cost":
      # Half a stage's tree too: the best half of the nodes holds most of the
      # expected accepted length.
      widths = tuple(sorted(set(widths) | {1 + self.tree_budget // 2}))
    return widths

  @property
  def gate_widths(self) -> list[int]:
    """The width of the forward that verifies s stages' drafts, s = 0..S_max."""
    per_stage = self.tree_budget or self.block_size
    return [self.fixed_width or 1 + n * per_stage for n in range(self.max_stages + 1)]


@struct.dataclass
class Inputs:
  """The decode program's traced arguments besides the weights.

  Attributes:
    prompts: [B, T_p] token ids, padded with 0.
    prompt_lengths: [B] int32.
    max_new_tokens: scalar int32, the row limit (programs are shared by every
      limit whose cache falls in one capacity bucket).
    stop: [stop_slots] stop token ids, padded with -1 (matches no token).
    key: the PRNG key.
    gate: DLoop's gate (`gate.Gate`).
    costs: [len(widths)] f32 the scheduler's cost of each compiled width.
    max_skip: scalar int32, the longest drafting pause (`draft_policy`).
    use_learned: scalar bool, the scheduler reads the drafter's learned confidence.
  """

  prompts: jax.Array
  prompt_lengths: jax.Array
  max_new_tokens: jax.Array
  stop: jax.Array
  key: jax.Array
  gate: gate_lib.Gate
  costs: jax.Array
  max_skip: jax.Array
  use_learned: jax.Array


# Slots added per step of a growing cache (`cache_ladder`), and at most this
# many steps (each is one more compiled copy of the decode step).
GROW_STEP = 64
GROW_MAX_STEPS = 8


def cache_ladder(*, prompt_width: int, capacity: int) -> tuple[int, ...]:
  """Capacities a growing cache ("ar", `grow_cache`) goes through, ending at `capacity`.

  Every decode step attends over the whole cache, so at 512-token prompts a
  1,024-slot cache costs about three times the step of a 384-slot one
  (SmolLM2-135M, batch 64, CPU). A growing cache starts just past the prompt
  width and adds `GROW_STEP` slots (more when that would take over
  `GROW_MAX_STEPS` steps) whenever the longest row reaches its end; each step
  is a copy of the cache, once.
  """
  step = max(GROW_STEP, -(-(capacity - prompt_width) // GROW_MAX_STEPS))
  step = -(-step // GROW_STEP) * GROW_STEP
  first = min(capacity, -(-(prompt_width + 1) // GROW_STEP) * GROW_STEP)
  return tuple(range(first, capacity, step)) + (capacity,)


def _stop_slots(n: int) -> int:
  """Length of the stop-token array: 4, 8, 16, ... (a few lengths, shared programs)."""
  return max(4, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def bucket(n: int, *, minimum: int = 16) -> int:
  """Smallest of minimum, 2^k and 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) >= n.

  Half-octave buckets bound the padding at a third of the size (a prompt or
  cache padded to the next power of two wastes up to half of it; every forward
  attends over the whole cache) for at most twice the compiled shapes.
  """
  n = max(n, minimum)
  power = 1 << max(0, math.ceil(math.log2(n)))
  return power * 3 // 4 if power * 3 // 4 >= n and power >= 4 else power


def prompt_width(longest: int) -> int:
  """The width a batch whose longest prompt has `longest` tokens is padded to: with the
  cache capacity it follows from, what a compiled program is specialized to."""
  return bucket(longest)


def _check_prompts(prompts: list[list[int]], *, target: Transformer, max_new_tokens: int) -> None:
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ConfigError("Every prompt needs at least one token.")
  target_config = target.config
  vocab = target_config.vocab_size
  for p in prompts:
    if min(p) < 0 or max(p) >= vocab:
      raise ConfigError(f"Prompt token ids must be in [0, {vocab}); got {min(p)}..{max(p)}.")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > target_config.max_position_embeddings:
    raise PromptTooLongError(
        f"Prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the context"
        f" window of {target_config.max_position_embeddings} tokens of"
        f" {target_config.name or 'the target'}; shorten the prompt or ask for fewer new tokens.")


def make(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    config: DecodingConfig,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    seed: int | jax.Array = 0,
    stop_tokens: Sequence[int] = (),
    capture_taps: Sequence[int] = (),
    grow_cache: bool = False,
) -> tuple[Plan, DecodingConfig, tuple[Any, Any, Inputs]]:
  """Validates the arguments and plans the program (see `engine.generate` for them).

  Returns:
    (the plan, the resolved config, the program's arguments: the target's
    state, the drafter's parameters (None for "ar") and the `Inputs`).
  """
  if isinstance(config, DecodingConfig):
    arguments.validate_mode(config.mode)
    if grow_cache and config.fixed_width is None:
      config = config.replace(fixed_width=0)  # a growing cache runs at free widths
  config = config_lib.resolve(config, target=target, drafter=drafter)
  arguments.validate_max_new_tokens(max_new_tokens)
  speculative = config.mode != "ar"
  if capture_taps and speculative:
    raise ConfigError("capture_taps is only supported in mode='ar'.")
  if grow_cache and speculative:
    raise ConfigError("grow_cache is only supported in mode='ar' (speculative modes verify"
                      " several tokens per forward into a cache of fixed size).")
  if grow_cache and config.fixed_width:
    raise ConfigError("grow_cache and fixed_width do not combine: use one of the two.")
  prompts = [list(map(int, p)) for p in prompts]
  _check_prompts(prompts, target=target, max_new_tokens=max_new_tokens)

  stops = sorted(set(int(t) for t in stop_tokens))
  s_max = int(config.max_stages) if speculative else 1
  gamma = int(config.block_size) if speculative else 0
  fixed_width = int(config.fixed_width)
  tp = prompt_width(max(len(p) for p in prompts))
  # Room past the last token for the widest write: a verification, or the
  # drafter's commit of a pause (`deferred`), which starts before the end.
  capacity = bucket(tp + max_new_tokens + max(s_max * gamma, deferred_lib.CAPACITY, fixed_width)
                    + 1, minimum=64)
  target_graph, target_state = nnx.split(target)
  drafter_graph, drafter_params = (nnx.split(drafter) if speculative else (None, None))
  plan = Plan(
      target_graph=target_graph, drafter_graph=drafter_graph, speculative=speculative,
      block_size=gamma, max_stages=s_max, sampling=config.sampling,
      stop_slots=_stop_slots(len(stops)), capture_taps=tuple(int(t) for t in capture_taps),
      batch_size=len(prompts), prompt_width=tp, capacity=capacity,
      tree_budget=int(config.tree_budget) if speculative else 0, grow_cache=bool(grow_cache),
      fixed_width=fixed_width, schedule=config.schedule if speculative else "off")
  if config.lookup == "prompt":  # only then do its options shape the program
    plan = dataclasses.replace(
        plan, lookup=True, lookup_min_match=int(config.lookup_min_match),
        lookup_max_probability=float(config.lookup_max_probability))

  # One cost table for the scheduler and gate="auto" (read, or measured, once).
  auto = plan.loops and config.gate == arguments.AUTO_GATE
  table = None
  if plan.schedule == "cost" or auto:
    needed = set(plan.gate_widths if auto else ()) | set(
        plan.widths if plan.schedule == "cost" else ())
    table = costs_lib.resolve_table(config.costs, target=target, batch_size=len(prompts),
                                    widths=sorted(needed | {1}), profile=config.profile)
  if plan.schedule == "cost":
    cost = table.at(plan.widths)
    keep = schedule_lib.choosable_widths(plan.widths, [float(c) for c in cost],
                                         tolerance=config.width_tolerance)
    if keep != plan.widths:
      cost = np.asarray([c for w, c in zip(plan.widths, cost) if w in keep], np.float32)
      plan = dataclasses.replace(plan, choosable=keep)
  else:
    cost = np.ones((len(plan.widths),), np.float32)  # unused

  padded = np.zeros((len(prompts), tp), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  stop_array = np.full((plan.stop_slots,), -1, np.int32)  # -1 matches no token
  stop_array[:len(stops)] = stops
  inputs = Inputs(
      prompts=jnp.asarray(padded), prompt_lengths=jnp.asarray(lengths),
      max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32), stop=jnp.asarray(stop_array),
      key=jax.random.key(seed) if isinstance(seed, int) else seed,
      gate=_gate(config, plan=plan, target=target, drafter=drafter, batch_size=len(prompts),
                 table=table),
      costs=jnp.asarray(cost, jnp.float32),
      max_skip=jnp.asarray(config.draft_backoff, jnp.int32),
      use_learned=jnp.asarray(config.confidence != "probability" and speculative
                              and drafter.has_confidence))
  if target.mesh is not None:
    # A target placed on a mesh: rows over its data axis, the rest replicated;
    # the jit follows these shardings (`models.sharding`).
    mesh = target.mesh
    sharding_lib.check_batch(len(prompts), mesh)
    inputs = sharding_lib.replicate(inputs, mesh).replace(
        prompts=sharding_lib.place(padded, sharding_lib.batch_spec(2), mesh),
        prompt_lengths=sharding_lib.place(lengths, sharding_lib.batch_spec(1), mesh))
    drafter_params = sharding_lib.replicate(drafter_params, mesh)
  return plan, config, (target_state, drafter_params, inputs)


def _gate(config: DecodingConfig, *, plan: Plan, target: Transformer,
          drafter: Drafter | None, batch_size: int, table) -> gate_lib.Gate:
  """The gate's traced settings: dloop's threshold, or the calibrated rule with the cost
  `table`'s costs (the forward verifying s stages' drafts, `Plan.gate_widths`, and a
  drafting stage, `costs.draft_stage_fraction` of a one-token forward: measured here when
  cached, measured now with costs="calibrate", else modeled; modeled with a profile's
  default table, which stands for another machine)."""
  s_max = plan.max_stages
  if not plan.loops or config.gate != arguments.AUTO_GATE:
    threshold = config.gate if plan.loops else 0.0
    return gate_lib.Gate.create(threshold=threshold, max_stages=s_max)
  widths = plan.gate_widths
  cost_at = dict(zip([1] + widths, (float(c) for c in table.at([1] + widths))))
  if costs_lib.is_assumed(table):
    # A profile's table stands for another machine: so does the modeled stage.
    fraction = costs_lib.modeled_draft_stage_fraction(drafter, target,
                                                      block_size=plan.block_size)
  else:
    fraction = costs_lib.draft_stage_fraction(
        drafter, target, block_size=plan.block_size, batch_size=batch_size,
        measure=isinstance(config.costs, str) and config.costs == costs_lib.CALIBRATE)
  stage = cost_at[1] * fraction
  return gate_lib.Gate.create(
      max_stages=s_max, table=config_lib.calibration_table(config, drafter=drafter),
      stage_cost=stage, verify_cost=[cost_at[w] for w in widths])
