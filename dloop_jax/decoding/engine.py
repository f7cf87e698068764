"""`generate()`: prefill, then a `lax.while_loop` over rounds, as one jit.

Modes:
  ar     one target forward per new token.
  sd     standard speculative decoding: one drafting stage of gamma tokens,
         then one verification.
  dloop  DLoop: another stage while the drafter's confidence in the stage just
         drafted is at least the gate g (at most S_max stages), then ONE
         verification of all drafts.

Per round of `sd` / `dloop`, for every row b (rows are independent; there is no
minimum over the batch):

    committed: x_0 .. x_n       (x_n = `pending`, not yet read by the target)
    drafts:    d_1 .. d_{s_b * gamma}    from s_b gated stages
    schedule:  verify the first v_b of them (`schedule`: the prefix whose
               expected committed tokens per unit of target time is best, from
               the drafter's confidences and the per-width cost table;
               schedule="off" verifies all, v_b = s_b * gamma)
    verify:    target([x_n, d_1, ..., d_m]) of width 1 + m, m >= max_b v_b, a
               `lax.switch` branch among the compiled widths
               (`schedule.verify_widths`)
    accept:    k_b <= v_b drafts, plus the bonus token; roll the caches back to
               n + 1 + k_b by setting lengths.

With `fixed_width=W` every target forward after prefill is W tokens wide
(plain steps padded, every draft verified), so that all modes at one W give
bit-identical greedy outputs in any weight dtype (docs/decoding.md).

With `lookup="prompt"` a row whose drafter is unsure of its first draft, and
whose newest tokens occurred earlier in its prompt or output, verifies the
tokens that followed them instead of its stages (`decoding.lookup`).

With `tree_budget=B > 0` a round drafts, verifies and accepts a draft tree
instead (`decoding.tree_round`: top-B prefixes per stage, one forward over the
whole tree, the walk, compaction of the accepted path).

A Python-side cache keyed by every static choice (model structure, shapes,
mode, gamma, S_max, schedule, sampling, stop tokens) holds the compiled
executables, so a second call with the same shapes runs without tracing or
compiling. The gate g, the cost table, the back-off and the source of the
scheduler's confidences (`confidence=`) are traced arrays: sweeping them does
not recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax import compilation_cache
from dloop_jax.decoding import arguments
from dloop_jax.decoding import config as config_lib
from dloop_jax.decoding import costs as costs_lib
from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import draft_policy
from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import stats as stats_lib
from dloop_jax.decoding import tree_round
from dloop_jax.decoding import verify as verify_lib
from dloop_jax.decoding.config import DecodingConfig
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.decoding.stats import GenerationOutput
from dloop_jax.errors import ConfigError, PromptTooLongError
from dloop_jax.models import cpu_kernels
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import sharding as sharding_lib
from dloop_jax.models.registry import LoadedTarget
from dloop_jax.models.transformer import Transformer


MODES = arguments.MODES


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the compiled program depends on besides array values."""

  target_graph: Any
  drafter_graph: Any
  mode: str
  block_size: int
  max_stages: int
  schedule: str
  sampling: sampling_lib.SamplingConfig
  stop_slots: int  # length of the traced stop-token array (padded with -1)
  capture_taps: tuple[int, ...]
  batch_size: int
  prompt_width: int
  capacity: int
  tree_budget: int = 0  # nodes per stage of a draft tree; 0: chains (`decoding.tree_round`)
  grow_cache: bool = False  # "ar" only: the cache grows in steps (`cache_ladder`)
  fixed_width: int = 0  # every target forward after prefill has this width (0: as needed)
  # The widths the cost table leaves worth compiling (`schedule.choosable_widths`);
  # empty: every candidate width.
  choosable: tuple[int, ...] = ()
  # Prompt lookup in the first stage (`decoding.lookup`): off, or its rule's
  # shortest match and the drafter's first-draft probability below which it
  # fires (the config's; unused, 0, without the lookup).
  lookup: bool = False
  lookup_min_match: int = 0
  lookup_max_probability: float = 0.0

  @property
  def draft_width(self) -> int:
    return self.max_stages * self.block_size if self.mode != "ar" else 0

  @property
  def verify_width(self) -> int:
    return max(1 + self.draft_width, self.fixed_width)

  @property
  def widths(self) -> tuple[int, ...]:
    """The compiled verification widths."""
    if self.choosable:
      return self.choosable
    return self.candidate_widths

  @property
  def candidate_widths(self) -> tuple[int, ...]:
    """The widths a round of this shape may verify, before the cost table prunes them."""
    if self.mode == "ar":
      return (1,)
    if self.fixed_width:
      return (self.fixed_width,)
    if not self.tree_budget:
      return schedule_lib.verify_widths(block_size=self.block_size, max_stages=self.max_stages,
                                        schedule=self.schedule)
    nodes = tree_round.max_nodes(budget=self.tree_budget, block_size=self.block_size,
                                 max_stages=self.max_stages, dloop=self.mode == "dloop")
    widths = schedule_lib.widths_for_drafts(nodes, schedule=self.schedule)
    if self.schedule == "cost":
      # Half a stage's tree too: the best half of the nodes holds most of the
      # expected accepted length.
      widths = tuple(sorted(set(widths) | {1 + self.tree_budget // 2}))
    return widths


@struct.dataclass
class _Loop:
  cache: kv_lib.KVCache
  drafter_state: Any
  pending: jax.Array  # [B] last committed token, not yet read by the target
  out: jax.Array  # [B, max_new + W] generated tokens
  num_new: jax.Array  # [B]
  done: jax.Array  # [B] bool
  features: jax.Array  # [B, C, n_taps, D] captured target taps (AR capture only)
  stats: stats_lib.DeviceStats  # `RowStats`' counters per row
  backoff: draft_policy.Backoff  # which rows draft this round
  deferred: deferred_lib.Deferred | None  # what the drafter reads when drafting resumes
  round: jax.Array  # scalar


_TRACE_COUNT = 0
_COMPILED: dict[_Static, Any] = {}


def trace_count() -> int:
  """How many times a decode program has been traced (and so compiled)."""
  return _TRACE_COUNT


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


def _pad_axis1(x: jax.Array, width: int) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, width - x.shape[1])
  return jnp.pad(x, pad)


def _verify(*, target: Transformer, taps: tuple[int, ...], cache: kv_lib.KVCache,
            pending: jax.Array, drafts: jax.Array, probs: jax.Array | None,
            num_verified: jax.Array, branch: jax.Array, widths: tuple[int, ...],
            sampling: sampling_lib.SamplingConfig, key: jax.Array) -> finish_lib.Verified:
  """Verifies the first `num_verified[b]` drafts of each row in one target forward.

  The forward's width is `widths[branch]` (a `lax.switch` over the compiled
  widths); outputs are padded to W = 1 + drafts.shape[1].

  Args:
    pending: [B] last committed token (position `cache.lengths`).
    drafts: [B, M] drafted tokens; probs [B, M, V] their draft distributions
      (sampling only).
    num_verified: [B] drafts to verify, at most `widths[branch] - 1`.
  """
  if widths[-1] - 1 > drafts.shape[1]:  # a fixed width wider than the drafts
    drafts = _pad_axis1(drafts, widths[-1] - 1)
    probs = None if probs is None else _pad_axis1(probs, widths[-1] - 1)
  pad_to = 1 + drafts.shape[1]
  starts = cache.lengths
  # With several widths, each branch only reads the cache (a branch that wrote
  # it would get a whole copy); the new keys / values come out padded to the
  # widest branch and are written after the switch.
  read_only = len(widths) > 1

  def branch_fn(width: int):
    m = width - 1

    def run(cache):
      tokens = jnp.concatenate([pending[:, None], drafts[:, :m]], axis=1)
      positions = starts[:, None] + jnp.arange(width)[None, :]
      o = target(tokens, positions=positions, cache=cache, taps=taps, write_cache=not read_only)
      if sampling.greedy:
        acc = verify_lib.accept_greedy(logits=o.logits, drafts=drafts[:, :m],
                                       num_drafts=num_verified)
      else:
        acc = verify_lib.accept_sampling(
            key=key, logits=o.logits, drafts=drafts[:, :m], draft_probs=probs[:, :m],
            num_drafts=num_verified, config=sampling)
      written = jax.tree.map(lambda x: _pad_axis1(x, pad_to), o.new_kv) if read_only else o.cache
      return (written, acc.num_accepted, _pad_axis1(acc.new_tokens, pad_to),
              _pad_axis1(o.taps, pad_to), _pad_axis1(tokens, pad_to),
              jnp.asarray(width, jnp.int32))

    return run

  if read_only:
    written, k, new_tokens, taps_out, tokens, width = jax.lax.switch(
        branch, [branch_fn(w) for w in widths], cache)
    # Slots past the accepted tokens hold padding; the caller's lengths mask them.
    cache = cache.append(written)
  else:
    cache, k, new_tokens, taps_out, tokens, width = branch_fn(widths[0])(cache)
  return finish_lib.Verified(cache=cache, num_accepted=k, new_tokens=new_tokens, tokens=tokens,
                   taps=taps_out, width=width)


def _decode(static: _Static, target_state, drafter_state_params, prompts, prompt_lengths,
            max_new_tokens, stop, key, gate, costs, max_skip, use_learned):
  """The whole generation as one traced program."""
  global _TRACE_COUNT
  _TRACE_COUNT += 1
  s = static
  target: Transformer = nnx.merge(s.target_graph, target_state)
  drafter: Drafter | None = (nnx.merge(s.drafter_graph, drafter_state_params)
                             if s.drafter_graph is not None else None)
  b, tp, cap = s.batch_size, s.prompt_width, s.capacity
  taps = tuple(drafter.taps) if drafter is not None else s.capture_taps
  gamma = s.block_size
  w_max = s.verify_width
  widths = s.widths
  step_width = s.fixed_width or 1  # tokens a plain decode step's forward reads

  # ------------------------------------------------------------------ prefill
  ladder = cache_ladder(prompt_width=tp, capacity=cap) if s.grow_cache else (cap,)
  # The prompts attend over their own tp slots only (an empty cache has nothing
  # else to offer), not over the whole capacity: at 3-token prompts in a 64-slot
  # cache that is a quarter of the attention work. The cache then grows to its
  # first capacity, one copy.
  cache = target.init_cache(batch_size=b, capacity=tp)
  positions = jnp.broadcast_to(jnp.arange(tp)[None, :], (b, tp))
  # Padding past the longest prompt is left out of a chunked prefill (a
  # 7,000-token prompt runs 7,168 of its 8,192-wide bucket).
  pre = target(prompts, positions=positions, cache=cache, taps=taps,
               logit_positions=(prompt_lengths - 1)[:, None], num_valid=prompt_lengths)
  key, first_key = jax.random.split(key)
  first = sampling_lib.next_token(first_key, pre.logits[:, 0], s.sampling)
  cache = pre.cache.with_lengths(prompt_lengths).grow(ladder[0])
  counts, done = finish_lib.commit_counts(
      new_tokens=first[:, None], num_valid=jnp.ones((b,), jnp.int32),
      num_new=jnp.zeros((b,), jnp.int32), max_new_tokens=max_new_tokens, stop=stop)
  # Room for every token that fits the cache, plus the widest round's overshoot
  # (cut by the row limit, a traced value: programs are shared by all the
  # limits whose cache falls in one capacity bucket).
  out = jnp.zeros((b, cap - tp + w_max), jnp.int32).at[:, 0].set(first)

  n_taps = len(taps)
  if s.capture_taps:
    features = jnp.zeros((b, cap, n_taps, target.config.hidden_size), pre.taps.dtype)
    features = kv_lib.write_rows(features, pre.taps, jnp.zeros((b,), jnp.int32))
  else:
    features = jnp.zeros((b, 0, n_taps, target.config.hidden_size), jnp.float32)

  drafter_state = None
  if drafter is not None:
    drafter_state = drafter.init_state(batch_size=b, capacity=cap)
    t = jnp.arange(tp)[None, :]
    shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((b, 1), prompts.dtype)], axis=1)
    next_tokens = jnp.where(t == (prompt_lengths - 1)[:, None], first[:, None], shifted)
    drafter_state = drafter.commit(
        drafter_state, tokens=prompts, features=pre.taps, next_tokens=next_tokens,
        starts=jnp.zeros((b,), jnp.int32), counts=prompt_lengths)

  zeros = jnp.zeros((b,), jnp.int32)
  # The commit after the prefill is the drafter's first forward.
  stats = stats_lib.device_zeros(batch_size=b, max_stages=s.max_stages,
                                 drafter_forwards=zeros + (1 if drafter is not None else 0))
  loop = _Loop(cache=cache, drafter_state=drafter_state, pending=first, out=out,
               num_new=counts, done=done, features=features, stats=stats,
               backoff=draft_policy.Backoff.create(b),
               deferred=(deferred_lib.Deferred.create(
                   batch_size=b, num_taps=n_taps, hidden_size=target.config.hidden_size,
                   dtype=pre.taps.dtype) if drafter is not None else None),
               round=jnp.zeros((), jnp.int32))

  def cond(lp: _Loop):
    return jnp.any(~lp.done) & (lp.round < max_new_tokens)

  def target_step(lp: _Loop, taps: tuple[int, ...]):
    """The target reads the pending token (cache written in place) and picks the next one.

    With a fixed width the token is the first of `fixed_width` (the rest
    padding, written to slots past the row's length, which mask them and which
    the next write reuses), so that the step runs the same program shape as a
    verification.

    Returns the cache (lengths unchanged), the taps at the token [B, 1, n, D],
    the next token [B], and its commit counts / finished [B].
    """
    starts = lp.cache.lengths
    tokens = _pad_axis1(lp.pending[:, None], step_width)
    positions = starts[:, None] + jnp.arange(step_width)[None, :]
    o = target(tokens, positions=positions, cache=lp.cache, taps=taps)
    token = sampling_lib.next_token(jax.random.fold_in(key, lp.round), o.logits[:, 0], s.sampling)
    counts, finished = finish_lib.commit_counts(
        new_tokens=token[:, None], num_valid=(~lp.done).astype(jnp.int32), num_new=lp.num_new,
        max_new_tokens=max_new_tokens, stop=stop)
    return o.cache.with_lengths(starts), o.taps[:, :1], token, counts, finished

  def ar_round(lp: _Loop) -> _Loop:
    active = ~lp.done
    starts = lp.cache.lengths
    cache, tapped, token, counts, finished = target_step(lp, s.capture_taps)
    features = lp.features
    if s.capture_taps:
      features = kv_lib.write_rows(features, tapped, starts)
    st = lp.stats
    st = st.replace(rounds=st.rounds + active,
                    committed_in_rounds=st.committed_in_rounds + counts,
                    target_tokens=st.target_tokens + active * step_width)
    return lp.replace(
        cache=cache.with_lengths(jnp.where(active, starts + 1, starts)),
        pending=jnp.where(active, token, lp.pending),
        out=kv_lib.write_rows(lp.out, token[:, None], lp.num_new),
        num_new=lp.num_new + counts, done=lp.done | finished, features=features,
        stats=st, round=lp.round + 1)

  def speculative_round(lp: _Loop) -> _Loop:
    active = ~lp.done
    starts = lp.cache.lengths
    round_key = jax.random.fold_in(key, lp.round)
    draft_key, accept_key = jax.random.split(round_key)
    # The drafter first reads the tokens of the pause before this round, if any.
    dstate, deferred, caught_up = deferred_lib.flush(
        lp.deferred, drafter=drafter, drafter_state=lp.drafter_state, committed_length=starts)

    # ------------------------------------------------------- gated drafting
    drafts0 = jnp.zeros((b, s.draft_width), jnp.int32)
    conf0 = jnp.zeros((b, s.draft_width), jnp.float32)
    probs0 = (None if s.sampling.greedy else
              jnp.zeros((b, s.draft_width, target.config.vocab_size), jnp.float32))

    proposal = None
    if s.lookup:
      history, lengths = lookup_lib.committed_history(
          prompts=prompts, prompt_lengths=prompt_lengths, out=lp.out, num_new=lp.num_new)
      # As many tokens as the round drafts at most: dloop's S_max stages of
      # gamma, so that a lookup round verifies as wide as a drafted one.
      proposal = lookup_lib.propose(history=history, lengths=lengths,
                                    block_size=s.draft_width, min_match=s.lookup_min_match)

    def stage_cond(c):
      stage, _, _, _, _, _, going, _, _ = c
      return (stage < s.max_stages) & jnp.any(going)

    def stage_body(c):
      stage, dstate, drafts, conf, probs, num_stages, going, looked_up, outlook = c
      dstate, drafted = drafter.draft_stage(
          dstate, key=jax.random.fold_in(draft_key, stage), block_size=gamma, sampling=s.sampling)
      drafts = jax.lax.dynamic_update_slice(drafts, drafted.tokens.astype(jnp.int32),
                                            (0, stage * gamma))
      if s.schedule == "cost":
        c_k = schedule_lib.draft_confidence(logprobs=drafted.logprobs, probs=drafted.probs,
                                            config=s.sampling)
        if drafted.confidence is not None:  # a traced choice: no recompile when switched
          c_k = jnp.where(use_learned, drafted.confidence.astype(jnp.float32), c_k)
        conf = jax.lax.dynamic_update_slice(conf, c_k, (0, stage * gamma))
      if probs is not None:
        probs = jax.lax.dynamic_update_slice(probs, drafted.probs.astype(jnp.float32),
                                             (0, stage * gamma, 0))
      num_stages = num_stages + going
      if s.lookup:
        # Decided from the first stage only; a row that takes the lookup's
        # drafts stops there, since later stages continue the drafter's own.
        looked_up = looked_up | ((stage == 0) & lookup_lib.fires(
            proposal=proposal, first_logprob=drafted.logprobs[:, 0], drafting=going,
            min_match=s.lookup_min_match, max_probability=s.lookup_max_probability))
        going = going & ~looked_up
      if s.mode == "dloop":
        learned = (None if drafted.confidence is None else
                   gate_lib.learned_stage_confidence(drafted.confidence))
        more, outlook = gate_lib.decide(
            gate, outlook, score=gate_lib.stage_confidence(drafted.logprobs),
            learned_score=learned, stages_done=stage + 1, max_stages=s.max_stages)
        going = going & more
      else:
        going = jnp.zeros_like(going)
      return stage + 1, dstate, drafts, conf, probs, num_stages, going, looked_up, outlook

    _, dstate, drafts, conf, probs, num_stages, _, looked_up, _ = jax.lax.while_loop(
        stage_cond, stage_body,
        (jnp.zeros((), jnp.int32), dstate, drafts0, conf0, probs0, zeros,
         draft_policy.wants_draft(lp.backoff, active=active), jnp.zeros((b,), bool),
         gate_lib.Outlook.start(b)))
    num_drafts = num_stages * gamma
    if s.lookup:
      # The lookup's drafts replace the drafter's, up to the round's whole
      # draft width; a short proposal is fewer drafts. The scheduler takes
      # them as certain: the rule that fires the lookup was measured with
      # every lookup draft verified.
      drafts = jnp.where(looked_up[:, None], proposal.tokens, drafts)
      conf = jnp.where(looked_up[:, None], 1.0, conf)
      num_drafts = jnp.where(looked_up, proposal.num_tokens, num_drafts)
      lp = lp.replace(stats=lp.stats.replace(
          lookup_rounds=lp.stats.lookup_rounds + looked_up.astype(jnp.int32)))

    # ------------------------------------------- what to verify, then verify it
    if s.schedule == "cost":
      choice = schedule_lib.choose(confidence=conf, num_drafts=num_drafts, active=active,
                                   widths=widths, costs=costs, causal=not s.sampling.greedy)
    else:
      choice = schedule_lib.verify_all(num_drafts=num_drafts, active=active, widths=widths)
    v = _verify(target=target, taps=drafter.taps, cache=lp.cache, pending=lp.pending,
                drafts=drafts, probs=probs, num_verified=choice.num_verified,
                branch=choice.branch, widths=widths, sampling=s.sampling, key=accept_key)

    return finish_lib.finish_round(
        lp, v=v, drafter=drafter, drafter_state=dstate, deferred=deferred, caught_up=caught_up,
        num_stages=num_stages, num_drafted=num_drafts, num_verified=choice.num_verified,
        block_size=gamma, max_stages=s.max_stages, max_new_tokens=max_new_tokens, stop=stop,
        max_skip=max_skip)

  def paused_step(lp: _Loop) -> _Loop:
    """A plain decode step while every active row pauses drafting (`draft_policy`).

    The same target step as `ar_round` (one token, written in place); what the
    drafter would read is kept for the round that drafts next (`deferred`): no
    drafter forward, no verification widths.
    """
    active = ~lp.done
    act = active.astype(jnp.int32)
    starts = lp.cache.lengths
    cache, tapped, token, counts, finished = target_step(lp, drafter.taps)
    committed = counts > 0
    deferred = deferred_lib.push(lp.deferred, token=lp.pending, features=tapped,
                                 next_token=token, committed=committed)
    st = lp.stats
    st = st.replace(rounds=st.rounds + act, committed_in_rounds=st.committed_in_rounds + counts,
                    plain_rounds=st.plain_rounds + act,
                    target_tokens=st.target_tokens + act * step_width,
                    stage_histogram=st.stage_histogram.at[:, 0].add(act))
    return lp.replace(
        cache=cache.with_lengths(jnp.where(committed, starts + 1, starts)),
        deferred=deferred, pending=jnp.where(committed, token, lp.pending),
        out=kv_lib.write_rows(lp.out, token[:, None], lp.num_new),
        num_new=lp.num_new + counts, done=lp.done | finished, stats=st,
        backoff=draft_policy.update(lp.backoff, drafted=jnp.zeros_like(active), accepted=zeros,
                                    max_skip=max_skip),
        round=lp.round + 1)

  def all_paused(lp: _Loop):
    return (cond(lp) & ~jnp.any(draft_policy.wants_draft(lp.backoff, active=~lp.done))
            & ~jnp.any(deferred_lib.full(lp.deferred)))

  def tree_spec_round(lp: _Loop) -> _Loop:
    return tree_round.run_round(
        lp, target=target, drafter=drafter, mode=s.mode, block_size=gamma,
        max_stages=s.max_stages, budget=s.tree_budget, sampling=s.sampling,
        max_new_tokens=max_new_tokens, key=key, gate=gate, stop=stop, max_skip=max_skip,
        schedule=s.schedule, widths=widths, costs=costs)

  spec_round = tree_spec_round if s.tree_budget else speculative_round

  def round_then_pauses(lp: _Loop) -> _Loop:
    # A speculative round, then the plain steps of a pause in a loop of their
    # own (none while some active row is due to draft, or once all are done).
    return jax.lax.while_loop(all_paused, paused_step, spec_round(lp))

  if s.mode == "ar":
    for i, slots in enumerate(ladder):
      if i:
        loop = loop.replace(cache=loop.cache.grow(slots))
      # A step writes slots `lengths` .. `lengths + width - 1` of every row.
      loop = jax.lax.while_loop(
          lambda lp, slots=slots: cond(lp) & (jnp.max(lp.cache.lengths) + step_width <= slots),
          ar_round, loop)
  else:
    loop = jax.lax.while_loop(cond, round_then_pauses, loop)
  return loop.out, loop.num_new, loop.stats, loop.features


def clear_compiled() -> None:
  """Frees every program `generate()` has compiled (one per mode and shape bucket).

  Each compiled XLA:CPU program holds its own memory mappings; a process that
  compiles hundreds of shapes (a sweep over many configurations, a test suite)
  can reach the kernel's per-process limit (`vm.max_map_count`), where XLA
  aborts. The next call of a shape compiles it again. JAX's own caches hold
  the same executables, so they are cleared too (`jax.clear_caches()`: other
  jitted functions recompile on their next call as well).
  """
  _COMPILED.clear()
  jax.clear_caches()


def _stop_slots(n: int) -> int:
  """Length of the stop-token array: 4, 8, 16, ... (a few lengths, shared programs)."""
  return max(4, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _bucket(n: int, *, minimum: int = 16) -> int:
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
  return _bucket(longest)


def _prepare(
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
) -> tuple[_Static, tuple]:
  """Validates arguments; returns the static key and the array arguments."""
  if isinstance(config, DecodingConfig):
    arguments.validate_mode(config.mode)
    if grow_cache and config.fixed_width is None:
      config = config.replace(fixed_width=0)  # a growing cache runs at free widths
  config = config_lib.resolve(config, target=target, drafter=drafter)
  arguments.validate_max_new_tokens(max_new_tokens)
  mode, block_size = config.mode, config.block_size
  max_stages, sampling = config.max_stages, config.sampling
  tree_budget, confidence, fixed_width = config.tree_budget, config.confidence, config.fixed_width
  if capture_taps and mode != "ar":
    raise ConfigError("capture_taps is only supported in mode='ar'.")
  if grow_cache and mode != "ar":
    raise ConfigError("grow_cache is only supported in mode='ar' (speculative modes verify"
                      " several tokens per forward into a cache of fixed size).")
  if grow_cache and fixed_width:
    raise ConfigError("grow_cache and fixed_width do not combine: use one of the two.")
  prompts = [list(map(int, p)) for p in prompts]
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

  stops = sorted(set(int(t) for t in stop_tokens))
  is_ar = mode == "ar"
  s_max = 1 if is_ar else int(max_stages)
  gamma = 0 if is_ar else int(block_size)
  tp = prompt_width(longest)
  # Room past the last token for the widest write: a verification, or the
  # drafter's commit of a pause (`deferred`), which starts before the end.
  capacity = _bucket(
      tp + max_new_tokens + max(s_max * gamma, deferred_lib.CAPACITY, fixed_width) + 1,
      minimum=64)
  target_graph, target_state = nnx.split(target)
  drafter_graph, drafter_params = (nnx.split(drafter) if (drafter is not None and not is_ar)
                                   else (None, None))
  static = _Static(
      target_graph=target_graph, drafter_graph=drafter_graph, mode=mode, block_size=gamma,
      max_stages=s_max, sampling=sampling,
      stop_slots=_stop_slots(len(stops)),
      capture_taps=tuple(int(t) for t in capture_taps), batch_size=len(prompts),
      prompt_width=tp, capacity=capacity, tree_budget=int(tree_budget) if not is_ar else 0,
      grow_cache=bool(grow_cache), fixed_width=int(fixed_width), schedule=(
          config.schedule if not is_ar else "off"))
  if config.lookup == "prompt":  # only then do its options shape the program
    static = dataclasses.replace(
        static, lookup=True, lookup_min_match=int(config.lookup_min_match),
        lookup_max_probability=float(config.lookup_max_probability))

  padded = np.zeros((len(prompts), tp), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  stop_array = np.full((static.stop_slots,), -1, np.int32)  # -1 matches no token
  stop_array[:len(stops)] = stops
  key = jax.random.key(seed) if isinstance(seed, int) else seed
  # One cost table for the scheduler and gate="auto" (read, or measured, once).
  auto = static.mode == "dloop" and config.gate == arguments.AUTO_GATE
  table = None
  if static.schedule == "cost" or auto:
    needed = set(_gate_widths(static) if auto else ()) | set(
        static.widths if static.schedule == "cost" else ())
    table = costs_lib.resolve_table(config.costs, target=target, batch_size=len(prompts),
                                    widths=sorted(needed | {1}), profile=config.profile)
  if static.schedule == "cost":
    cost = table.at(static.widths)
    keep = schedule_lib.choosable_widths(static.widths, [float(c) for c in cost],
                                         tolerance=config.width_tolerance)
    if keep != static.widths:
      cost = np.asarray([c for w, c in zip(static.widths, cost) if w in keep], np.float32)
      static = dataclasses.replace(static, choosable=keep)
  else:
    cost = np.ones((len(static.widths),), np.float32)  # unused
  gate = _gate(config, static=static, target=target, drafter=drafter, batch_size=len(prompts),
               table=table)
  args = (target_state, drafter_params, jnp.asarray(padded), jnp.asarray(lengths),
          jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(stop_array), key,
          gate, jnp.asarray(cost, jnp.float32),
          jnp.asarray(config.draft_backoff, jnp.int32),
          jnp.asarray(confidence != "probability" and not is_ar and drafter.has_confidence))
  if target.mesh is not None:
    # A target placed on a mesh: rows over its data axis, the rest replicated;
    # the jit follows these shardings (`models.sharding`).
    mesh = target.mesh
    sharding_lib.check_batch(len(prompts), mesh)
    rows = (sharding_lib.place(padded, sharding_lib.batch_spec(2), mesh),
            sharding_lib.place(lengths, sharding_lib.batch_spec(1), mesh))
    args = (args[0], *sharding_lib.replicate(args[1:2], mesh), *rows,
            *sharding_lib.replicate(args[4:], mesh))
  return static, args


def _gate_widths(static: _Static) -> list[int]:
  """The width of the forward that verifies s stages' drafts, s = 0..S_max."""
  per_stage = static.tree_budget or static.block_size
  return [static.fixed_width or 1 + n * per_stage for n in range(static.max_stages + 1)]


def _gate(config: DecodingConfig, *, static: _Static, target: Transformer,
          drafter: Drafter | None, batch_size: int, table) -> gate_lib.Gate:
  """The gate's traced settings: dloop's threshold, or the calibrated rule with the cost
  `table`'s costs (the forward verifying s stages' drafts, `_gate_widths`, and a drafting
  stage, `costs.draft_stage_fraction` of a one-token forward: measured here when cached,
  measured now with costs="calibrate", else modeled; modeled with a profile's default
  table, which stands for another machine)."""
  s_max = static.max_stages
  if static.mode != "dloop" or config.gate != arguments.AUTO_GATE:
    threshold = config.gate if static.mode == "dloop" else 0.0
    return gate_lib.Gate.create(threshold=threshold, max_stages=s_max)
  widths = _gate_widths(static)
  cost_at = dict(zip([1] + widths, (float(c) for c in table.at([1] + widths))))
  if costs_lib.is_assumed(table):
    # A profile's table stands for another machine: so does the modeled stage.
    fraction = costs_lib.modeled_draft_stage_fraction(drafter, target,
                                                      block_size=static.block_size)
  else:
    fraction = costs_lib.draft_stage_fraction(
        drafter, target, block_size=static.block_size, batch_size=batch_size,
        measure=isinstance(config.costs, str) and config.costs == costs_lib.CALIBRATE)
  stage = cost_at[1] * fraction
  return gate_lib.Gate.create(
      max_stages=s_max, table=config_lib.calibration_table(config, drafter=drafter),
      stage_cost=stage, verify_cost=[cost_at[w] for w in widths])


def _matmul_precision(target: Transformer):
  """The context a decode program is lowered in: f32 products at full precision.

  GPUs multiply f32 matrices in TF32 and TPUs in bf16 passes by default, far
  from what an f32 target promises (outputs equal `ar`'s up to near-ties of
  ~1e-3); a 16-bit target's products are 16-bit anyway, and a CPU's f32
  products are full precision already.
  """
  if jax.default_backend() == "cpu" or arguments.is_16_bit(target):
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")


def _kernel_forms(target: Transformer):
  """The product forms of the whole program, drafter included: the target's
  (`models.cpu_kernels`)."""
  return cpu_kernels.use(cpu_kernels.resolve(target.cpu_kernels))


@contextlib.contextmanager
def program_context(target: Transformer):
  """The context a program computing with `target` is traced and compiled in: the
  engine's f32 precision and the target's product forms (`generate()`'s, and what a
  measurement of the engine's numbers must use too)."""
  with _matmul_precision(target), _kernel_forms(target):
    yield


def _split_options(config: DecodingConfig | None, kwargs: dict) -> tuple[DecodingConfig, dict]:
  """(the config with the keyword overrides that name its fields, the other keywords)."""
  overrides = {k: v for k, v in kwargs.items() if k in config_lib.FIELDS}
  rest = {k: v for k, v in kwargs.items() if k not in config_lib.FIELDS}
  unknown = sorted(set(rest) - _CALL_OPTIONS)
  if unknown:
    raise ConfigError(f"generate() got unknown option(s) {unknown}; decoding options are"
                      f" {sorted(config_lib.FIELDS)} (or pass config=DecodingConfig(...)), call"
                      f" options {sorted(_CALL_OPTIONS)}.")
  return (config if config is not None else DecodingConfig()).replace(**overrides), rest


_CALL_OPTIONS = frozenset({"drafter", "seed", "stop_tokens", "capture_taps", "grow_cache"})


def decode_jaxpr(target: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 config: DecodingConfig | None = None, **kwargs):
  """The jaxpr of the program `generate()` would run (for inspection and tests)."""
  config, rest = _split_options(config, kwargs)
  static, args = _prepare(target, prompts, config=config, max_new_tokens=max_new_tokens, **rest)
  with _kernel_forms(target):
    return jax.make_jaxpr(lambda *a: _decode(static, *a))(*args)


def decode_program(target: Transformer, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, config: DecodingConfig | None = None, **kwargs):
  """(the compiled program `generate()` runs for these arguments, its static shape): for
  inspecting the optimized program (`decoding.loop_copies`); compiled once, shared with
  `generate()`."""
  config, rest = _split_options(config, kwargs)
  static, args = _prepare(target, prompts, config=config, max_new_tokens=max_new_tokens, **rest)
  compiled = _COMPILED.get(static)
  if compiled is None:
    compilation_cache.ensure()
    with program_context(target):
      compiled = jax.jit(_decode, static_argnums=0).lower(static, *args).compile()
    _COMPILED[static] = compiled
  return compiled, static


def generate(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    config: DecodingConfig | None = None,
    seed: int | jax.Array = 0,
    stop_tokens: Sequence[int] = (),
    capture_taps: Sequence[int] = (),
    grow_cache: bool = False,
    **options: Any,
) -> GenerationOutput:
  """Generates continuations of a batch of token-id prompts.

  Args:
    target: the target model (a `Transformer`, or the `LoadedTarget` that
      `load_target` returns). One placed on a device mesh (`load_target(...,
      mesh=)`) decodes there: rows over the mesh's data axis (B must be a
      multiple of its size), weights and KV heads as placed (docs/scaling.md).
    prompts: B prompts (lists of token ids, lengths may differ).
    max_new_tokens: new tokens per row at most (the first comes from prefill).
    drafter: drafter for "sd" / "dloop".
    config: a `DecodingConfig` holding the decoding options below (mode
      through allow_inexact); None: the defaults. Keyword options given as
      well override its fields: `generate(..., config=c, gate=-1.0)`.
    seed: int or PRNG key.
    stop_tokens: token ids that end a row (committed, then the row stops).
    capture_taps: ("ar" only) also return the target's tapped hidden states at
      every position read during generation.
    grow_cache: ("ar" only) start the KV cache just past the prompts and grow
      it in steps (`cache_ladder`), so that each step attends over about the
      live context instead of the whole capacity: faster long generations
      (dataset builds), a longer compile. Same tokens and taps up to
      floating-point summation order.
    **options: fields of `DecodingConfig`:

    mode: "ar", "sd" or "dloop".
    block_size: gamma, drafts per stage (default: the drafter's own).
    gate: DLoop's confidence gate g (only "dloop").
    max_stages: S_max (only "dloop"; "sd" always drafts one stage). None: 3,
      or what the fixed width holds (below).
    sampling: greedy by default.
    schedule: ("sd" / "dloop") "cost": verify only the prefix of the drafts
      whose expected committed tokens per unit of target time is best (see
      `decoding.schedule`; possibly none: a plain decode step); "off": verify
      every draft. None: "cost" for chains, "off" for trees. With a
      tree_budget, "cost" verifies the best b nodes of the tree by path
      score (`decoding.tree_round`).
    costs: with schedule="cost", the target forward's cost per width: a
      `costs.CostTable`, a {width: cost} mapping or a JSON file path. None: the
      file named by $DLOOP_COSTS if set, else this target's table on this
      machine at this batch size if one was measured (`python -m infer.costs`),
      else the profile's default table (with a warning). "calibrate": that
      table, measured and cached on disk first if missing (`decoding.costs`).
      The table is a traced value: changing it does not recompile.
    draft_backoff: ("sd" / "dloop") the longest pause, in rounds, of a row's
      drafting after rounds whose drafts were all rejected or not worth
      verifying (`decoding.draft_policy`: pauses double from 1 up to this;
      rounds in a pause are plain decode steps); 0 drafts every round. None:
      `config.DEFAULT_DRAFT_BACKOFF` with schedule="cost", else 0 (fixed widths too). A traced
      value: changing it does not recompile.
    lookup: ("sd" / "dloop", greedy chains) "prompt": where the newest
      `lookup_min_match`..3 tokens of a row occurred earlier in its prompt or
      output and the drafter's first draft has probability below
      `lookup_max_probability`, the round verifies the tokens that followed
      that occurrence instead of the drafter's stages (`decoding.lookup`;
      counted in `RowStats.lookup_rounds`); "off": the drafter's; "auto"
      (default): "prompt" for greedy chains of sd / dloop, "off" elsewhere.
    tree_budget: ("sd" / "dloop") B > 0 drafts a tree of the B best prefixes
      per stage (DDTree) and verifies the whole tree in one target forward
      (`decoding.tree_round`; drafters with `supports_trees`); 0: chains.
    confidence: (schedule="cost") where the scheduler's c_k come from:
      "drafter", the drafter's learned confidence (`Drafter.has_confidence`:
      DSpark's confidence head); "probability", the drafter's top draft
      probability (`schedule.draft_confidence`); "auto" (default), the first
      when the drafter has one. A traced value: switching does not recompile.
    fixed_width: W > 0 runs every target forward after prefill at width W:
      decode steps padded to W tokens, verifications of every draft padded to
      W (W >= 1 + max_stages * block_size; schedule "off"; chains only).
      Every forward is then the same program shape, in which XLA computes a
      token's row with the same bits wherever it sits, so greedy outputs of
      all modes run with the same W are bit-identical, with 16-bit weights
      and compute too. 0: each forward as wide as its tokens. None (default):
      the profile's width for a 16-bit target's chains (cpu 5, gpu / tpu 16;
      dloop then drafts the loop it verifies whole, 2 stages of 2 at W = 5,
      unless block_size / max_stages say otherwise, which widen W in every
      mode alike), 0 for f32 targets and trees (`arguments.resolve_shape`).
    profile: "cpu", "gpu", "tpu" or None (this backend's, `dloop_jax.profiles`):
      the defaults above.
    allow_inexact: run a 16-bit target's sd / dloop at free widths (trees,
      fixed_width=0, schedule="cost"), where greedy outputs equal `ar`'s
      only up to 16-bit rounding (`arguments.validate_exactness`); without it
      such a call raises a ConfigError naming the exact alternatives.

  Returns:
    A `GenerationOutput` with the new tokens and statistics of every row.
  """
  if isinstance(target, LoadedTarget):
    target = target.model
  config, _ = _split_options(config, options)
  static, args = _prepare(
      target, prompts, config=config, max_new_tokens=max_new_tokens, drafter=drafter,
      seed=seed, stop_tokens=stop_tokens, capture_taps=capture_taps, grow_cache=grow_cache)
  prompts = [list(p) for p in prompts]
  mode, gate = config.mode, config.gate
  is_ar = mode == "ar"
  if mode == "dloop" and gate != arguments.AUTO_GATE:
    gate = float(gate)
  gamma, s_max = static.block_size, static.max_stages

  compile_seconds = 0.0
  compiled = _COMPILED.get(static)
  if compiled is None:
    compilation_cache.ensure()
    t0 = time.perf_counter()
    with program_context(target):
      compiled = jax.jit(_decode, static_argnums=0).lower(static, *args).compile()
    compile_seconds = time.perf_counter() - t0
    _COMPILED[static] = compiled
  t0 = time.perf_counter()
  out, num_new, stats, features = compiled(*args)
  out = np.asarray(jax.device_get(out))
  seconds = time.perf_counter() - t0
  num_new = np.asarray(num_new)
  rows = stats_lib.to_rows(stats, num_new, speculative=not is_ar)
  feats = None
  if capture_taps:
    feats_np = np.asarray(features)
    # Positions read by the target: the prompt and every new token but the last.
    feats = [feats_np[i, :len(prompts[i]) + int(num_new[i]) - 1] for i in range(len(prompts))]
  return GenerationOutput(
      tokens=[out[i, :int(num_new[i])].tolist() for i in range(len(prompts))],
      rows=rows, seconds=seconds, compile_seconds=compile_seconds, mode=mode,
      block_size=gamma or None, gate=gate if mode == "dloop" else None,
      max_stages=s_max if not is_ar else None,
      schedule=static.schedule if not is_ar else None, features=feats,
      fixed_width=static.fixed_width or None, widths=static.widths)
