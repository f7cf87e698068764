"""The decode program: prefill, then a `lax.while_loop` over rounds.

`DecodeLoop` is built inside the trace from the `plan.Plan` (static), the
merged models and the traced `plan.Inputs`; its methods are the steps:

    prefill            the prompts in one forward; the first token; the
                       drafter reads the prompts
    ar_step            "ar": one target forward per new token
    speculative_round  propose (gated stages of chains or trees, `proposal`),
                       choose the drafts to verify (`schedule`), verify in
                       one target forward, commit (`_commit`)
    paused_step        while every active row pauses its drafting
                       (`draft_policy`): a plain decode step whose tokens the
                       drafter reads when it drafts again (`deferred`)

A round commits, per row, the k accepted drafts and the target's token after
them; the caches roll back to n + 1 + k by setting lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import chain_round
from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import draft_policy
from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import stats as stats_lib
from dloop_jax.decoding import tree_round
from dloop_jax.decoding import verify as verify_lib
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.decoding.plan import Inputs, Plan, cache_ladder
from dloop_jax.decoding.proposal import Proposal, Proposer
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models.transformer import Transformer


@struct.dataclass
class LoopState:
  """What the loop carries from round to round.

  Attributes:
    cache: the target's KV cache; its lengths are the committed tokens.
    drafter_state: the drafter's (None for "ar").
    pending: [B] last committed token, not yet read by the target.
    out: [B, max_new + W] generated tokens.
    num_new: [B] tokens generated so far.
    done: [B] bool, rows that finished.
    features: [B, C, n_taps, D] captured target taps ("ar" with capture_taps).
    stats: `RowStats`' counters per row.
    backoff: which rows draft this round (`draft_policy`).
    deferred: what the drafter reads when drafting resumes (`deferred`).
    round: scalar, rounds so far.
  """

  cache: kv_lib.KVCache
  drafter_state: Any
  pending: jax.Array
  out: jax.Array
  num_new: jax.Array
  done: jax.Array
  features: jax.Array
  stats: stats_lib.DeviceStats
  backoff: draft_policy.Backoff
  deferred: deferred_lib.Deferred | None
  round: jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
  """One generation's decode loop (module docstring); built inside the trace."""

  plan: Plan
  target: Transformer
  drafter: Drafter | None
  inputs: Inputs

  @property
  def taps(self) -> tuple[int, ...]:
    """The target layers whose outputs the drafter reads (or "ar" captures)."""
    return tuple(self.drafter.taps) if self.drafter is not None else self.plan.capture_taps

  def run(self) -> LoopState:
    """The whole generation: prefill, then rounds until every row is done."""
    round_key, first_key = jax.random.split(self.inputs.key)
    lp = self.prefill(key=first_key)
    # Every round's randomness derives from the other half of the key.
    loop = dataclasses.replace(self, inputs=self.inputs.replace(key=round_key))
    if not self.plan.speculative:
      return loop._ar_loop(lp)
    return jax.lax.while_loop(loop._running, loop._round_then_pauses, lp)

  # ------------------------------------------------------------------ prefill

  def prefill(self, *, key: jax.Array) -> LoopState:
    """The prompts' forward, the first token (sampled with `key`), and the drafter's read
    of the prompts."""
    p, x, target = self.plan, self.inputs, self.target
    b, tp, cap = p.batch_size, p.prompt_width, p.capacity
    taps = self.taps
    # The prompts attend over their own tp slots only (an empty cache has
    # nothing else to offer), not over the whole capacity: at 3-token prompts
    # in a 64-slot cache that is a quarter of the attention work. The cache
    # then grows to its first capacity, one copy.
    cache = target.init_cache(batch_size=b, capacity=tp)
    positions = jnp.broadcast_to(jnp.arange(tp)[None, :], (b, tp))
    # Padding past the longest prompt is left out of a chunked prefill (a
    # 7,000-token prompt runs 7,168 of its 8,192-wide bucket).
    pre = target(x.prompts, positions=positions, cache=cache, taps=taps,
                 logit_positions=(x.prompt_lengths - 1)[:, None], num_valid=x.prompt_lengths)
    first = sampling_lib.next_token(key, pre.logits[:, 0], p.sampling)
    cache = pre.cache.with_lengths(x.prompt_lengths).grow(self._ladder[0])
    counts, done = finish_lib.commit_counts(
        new_tokens=first[:, None], num_valid=jnp.ones((b,), jnp.int32),
        num_new=jnp.zeros((b,), jnp.int32), max_new_tokens=x.max_new_tokens, stop=x.stop)
    # Room for every token that fits the cache, plus the widest round's
    # overshoot (cut by the row limit, a traced value: programs are shared by
    # all the limits whose cache falls in one capacity bucket).
    out = jnp.zeros((b, cap - tp + p.verify_width), jnp.int32).at[:, 0].set(first)

    hidden = target.config.hidden_size
    if p.capture_taps:
      features = jnp.zeros((b, cap, len(taps), hidden), pre.taps.dtype)
      features = kv_lib.write_rows(features, pre.taps, jnp.zeros((b,), jnp.int32))
    else:
      features = jnp.zeros((b, 0, len(taps), hidden), jnp.float32)

    drafter_state, deferred = None, None
    if self.drafter is not None:
      drafter_state = self.drafter.init_state(batch_size=b, capacity=cap)
      t = jnp.arange(tp)[None, :]
      shifted = jnp.concatenate([x.prompts[:, 1:], jnp.zeros((b, 1), x.prompts.dtype)], axis=1)
      next_tokens = jnp.where(t == (x.prompt_lengths - 1)[:, None], first[:, None], shifted)
      drafter_state = self.drafter.commit(
          drafter_state, tokens=x.prompts, features=pre.taps, next_tokens=next_tokens,
          starts=jnp.zeros((b,), jnp.int32), counts=x.prompt_lengths)
      deferred = deferred_lib.Deferred.create(batch_size=b, num_taps=len(taps),
                                              hidden_size=hidden, dtype=pre.taps.dtype)
    # The commit after the prefill is the drafter's first forward.
    stats = stats_lib.device_zeros(
        batch_size=b, max_stages=p.max_stages,
        drafter_forwards=jnp.full((b,), 1 if self.drafter is not None else 0, jnp.int32))
    return LoopState(cache=cache, drafter_state=drafter_state, pending=first, out=out,
                     num_new=counts, done=done, features=features, stats=stats,
                     backoff=draft_policy.Backoff.create(b), deferred=deferred,
                     round=jnp.zeros((), jnp.int32))

  @property
  def _ladder(self) -> tuple[int, ...]:
    p = self.plan
    return (cache_ladder(prompt_width=p.prompt_width, capacity=p.capacity) if p.grow_cache
            else (p.capacity,))

  # ------------------------------------------------------------- plain steps

  def _running(self, lp: LoopState) -> jax.Array:
    return jnp.any(~lp.done) & (lp.round < self.inputs.max_new_tokens)

  def _plain_forward(self, lp: LoopState, taps: tuple[int, ...]):
    """The target reads the pending token (cache written in place) and picks the next one.

    At a fixed width the token is the first of `fixed_width` (the rest
    padding, written to slots past the row's length, which mask them and
    which the next write reuses), so that the step runs the same program
    shape as a verification.

    Returns the cache (lengths unchanged), the taps at the token [B, 1, n, D],
    the next token [B], and its commit counts / finished [B].
    """
    width, x = self.plan.step_width, self.inputs
    starts = lp.cache.lengths
    tokens = verify_lib.pad_axis1(lp.pending[:, None], width)
    positions = starts[:, None] + jnp.arange(width)[None, :]
    o = self.target(tokens, positions=positions, cache=lp.cache, taps=taps)
    token = sampling_lib.next_token(jax.random.fold_in(x.key, lp.round), o.logits[:, 0],
                                    self.plan.sampling)
    counts, finished = finish_lib.commit_counts(
        new_tokens=token[:, None], num_valid=(~lp.done).astype(jnp.int32), num_new=lp.num_new,
        max_new_tokens=x.max_new_tokens, stop=x.stop)
    return o.cache.with_lengths(starts), o.taps[:, :1], token, counts, finished

  def ar_step(self, lp: LoopState) -> LoopState:
    """"ar": one token per row (and its taps, with capture_taps)."""
    active = ~lp.done
    starts = lp.cache.lengths
    cache, tapped, token, counts, finished = self._plain_forward(lp, self.plan.capture_taps)
    features = lp.features
    if self.plan.capture_taps:
      features = kv_lib.write_rows(features, tapped, starts)
    st = lp.stats
    st = st.replace(rounds=st.rounds + active,
                    committed_in_rounds=st.committed_in_rounds + counts,
                    target_tokens=st.target_tokens + active * self.plan.step_width)
    return lp.replace(
        cache=cache.with_lengths(jnp.where(active, starts + 1, starts)),
        pending=jnp.where(active, token, lp.pending),
        out=kv_lib.write_rows(lp.out, token[:, None], lp.num_new),
        num_new=lp.num_new + counts, done=lp.done | finished, features=features,
        stats=st, round=lp.round + 1)

  def _ar_loop(self, lp: LoopState) -> LoopState:
    width = self.plan.step_width
    for i, slots in enumerate(self._ladder):
      if i:
        lp = lp.replace(cache=lp.cache.grow(slots))
      # A step writes slots `lengths` .. `lengths + width - 1` of every row.
      lp = jax.lax.while_loop(
          lambda lp, slots=slots: self._running(lp) & (jnp.max(lp.cache.lengths) + width
                                                       <= slots),
          self.ar_step, lp)
    return lp

  def paused_step(self, lp: LoopState) -> LoopState:
    """A plain decode step while every active row pauses drafting (`draft_policy`).

    The same target step as `ar_step` (one token, written in place); what the
    drafter would read is kept for the round that drafts next (`deferred`): no
    drafter forward, no verification widths.
    """
    active = ~lp.done
    act = active.astype(jnp.int32)
    starts = lp.cache.lengths
    cache, tapped, token, counts, finished = self._plain_forward(lp, self.drafter.taps)
    committed = counts > 0
    deferred = deferred_lib.push(lp.deferred, token=lp.pending, features=tapped,
                                 next_token=token, committed=committed)
    st = lp.stats
    st = st.replace(rounds=st.rounds + act, committed_in_rounds=st.committed_in_rounds + counts,
                    plain_rounds=st.plain_rounds + act,
                    target_tokens=st.target_tokens + act * self.plan.step_width,
                    stage_histogram=st.stage_histogram.at[:, 0].add(act))
    return lp.replace(
        cache=cache.with_lengths(jnp.where(committed, starts + 1, starts)),
        deferred=deferred, pending=jnp.where(committed, token, lp.pending),
        out=kv_lib.write_rows(lp.out, token[:, None], lp.num_new),
        num_new=lp.num_new + counts, done=lp.done | finished, stats=st,
        backoff=draft_policy.update(lp.backoff, drafted=jnp.zeros_like(active),
                                    accepted=jnp.zeros_like(act),
                                    max_skip=self.inputs.max_skip),
        round=lp.round + 1)

  def _all_paused(self, lp: LoopState) -> jax.Array:
    return (self._running(lp)
            & ~jnp.any(draft_policy.wants_draft(lp.backoff, active=~lp.done))
            & ~jnp.any(deferred_lib.full(lp.deferred)))

  def _round_then_pauses(self, lp: LoopState) -> LoopState:
    # A speculative round, then the plain steps of a pause in a loop of their
    # own (none while some active row is due to draft, or once all are done).
    return jax.lax.while_loop(self._all_paused, self.paused_step, self.speculative_round(lp))

  # ------------------------------------------------------- speculative rounds

  def proposer(self) -> Proposer:
    """Chains or trees, as planned."""
    p, x = self.plan, self.inputs
    if p.tree_budget:
      return tree_round.TreeProposer(
          target=self.target, drafter=self.drafter, block_size=p.block_size,
          max_stages=p.max_stages, budget=p.tree_budget, sampling=p.sampling, gate=x.gate)
    return chain_round.ChainProposer(
        target=self.target, drafter=self.drafter, block_size=p.block_size,
        max_stages=p.max_stages, sampling=p.sampling, gate=x.gate,
        scored=p.schedule == "cost", use_learned=x.use_learned,
        lookup_min_match=p.lookup_min_match, lookup_max_probability=p.lookup_max_probability)

  def speculative_round(self, lp: LoopState) -> LoopState:
    """Propose, choose what to verify, verify, commit."""
    p, x = self.plan, self.inputs
    active = ~lp.done
    draft_key, accept_key = jax.random.split(jax.random.fold_in(x.key, lp.round))
    # The drafter first reads the tokens of the pause before this round, if any.
    dstate, deferred, caught_up = deferred_lib.flush(
        lp.deferred, drafter=self.drafter, drafter_state=lp.drafter_state,
        committed_length=lp.cache.lengths)
    lookup = None
    if p.lookup:
      history, lengths = lookup_lib.committed_history(
          prompts=x.prompts, prompt_lengths=x.prompt_lengths, out=lp.out, num_new=lp.num_new)
      # As many tokens as the round drafts at most, so that a lookup round
      # verifies as wide as a drafted one.
      lookup = lookup_lib.propose(history=history, lengths=lengths, block_size=p.draft_width,
                                  min_match=p.lookup_min_match)
    proposer = self.proposer()
    dstate, proposal = proposer.propose(
        dstate, going=draft_policy.wants_draft(lp.backoff, active=active), key=draft_key,
        lookup=lookup)
    if p.schedule == "cost":
      choice = schedule_lib.choose(confidence=proposal.confidence,
                                   num_drafts=proposal.num_drafts, active=active,
                                   widths=p.widths, costs=x.costs, causal=proposer.causal)
    else:
      choice = schedule_lib.verify_all(num_drafts=proposal.num_drafts, active=active,
                                       widths=p.widths)
    verified = proposer.verify(proposal, cache=lp.cache, pending=lp.pending, choice=choice,
                               widths=p.widths, key=accept_key)
    return self._commit(lp, verified=verified, proposal=proposal, choice=choice,
                        drafter_state=dstate, deferred=deferred, caught_up=caught_up)

  def _commit(self, lp: LoopState, *, verified: finish_lib.Verified, proposal: Proposal,
              choice: schedule_lib.Choice, drafter_state: Any, deferred: deferred_lib.Deferred,
              caught_up: jax.Array) -> LoopState:
    """Commits a verified round (`finish`).

    Args:
      lp: the loop state before the round.
      verified: the verification.
      proposal: what was drafted; choice: what of it was verified.
      drafter_state: the drafter's state after drafting.
      deferred: the drafter's unread memory after the round's flush.
      caught_up: [B] rows whose memory the round's flush read (one forward each).
    """
    v, x, drafter = verified, self.inputs, self.drafter
    active = ~lp.done
    starts = lp.cache.lengths
    counts, finished = finish_lib.commit_counts(
        new_tokens=v.new_tokens, num_valid=jnp.where(active, v.num_accepted + 1, 0),
        num_new=lp.num_new, max_new_tokens=x.max_new_tokens, stop=x.stop)
    committed = counts > 0
    last = jnp.take_along_axis(v.new_tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    # The drafter reads the committed tokens now if some row accepted a draft;
    # a round that committed one token per row (its drafts rejected or not
    # verified) leaves it to the next drafting round, like a paused step
    # (`deferred`): the drafter's unverified drafts are discarded then.
    read_now = jnp.any(counts > 1)

    def commit_now(dstate, deferred):
      return drafter.commit(dstate, tokens=v.tokens, features=v.taps, next_tokens=v.new_tokens,
                            starts=starts, counts=counts), deferred

    def commit_later(dstate, deferred):
      return dstate, deferred_lib.push(deferred, token=lp.pending, features=v.taps[:, :1],
                                       next_token=v.new_tokens[:, 0], committed=committed)

    drafter_state, deferred = jax.lax.cond(read_now, commit_now, commit_later, drafter_state,
                                           deferred)
    num_stages = proposal.num_stages
    act = active.astype(jnp.int32)
    st = lp.stats
    st = st.replace(
        rounds=st.rounds + act,
        committed_in_rounds=st.committed_in_rounds + counts,
        drafted=st.drafted + act * proposal.num_drafts,
        verified=st.verified + act * choice.num_verified,
        plain_rounds=st.plain_rounds + act * (choice.num_verified == 0),
        accepted=st.accepted + jnp.minimum(v.num_accepted, counts),
        # Drafting, the commit if it ran now, and the commit of what the
        # drafter had not read before the round, if any (`decoding.drafter`).
        drafter_forwards=st.drafter_forwards + act * (
            drafter.drafting_forwards(self.plan.block_size, num_stages) + read_now) + caught_up,
        target_tokens=st.target_tokens + act * v.width,
        stage_histogram=st.stage_histogram + act[:, None] * jax.nn.one_hot(
            num_stages, self.plan.max_stages + 1, dtype=jnp.int32),
        lookup_rounds=st.lookup_rounds + proposal.looked_up.astype(jnp.int32))
    return lp.replace(
        cache=v.cache.with_lengths(jnp.where(committed, starts + counts, starts)),
        drafter_state=drafter_state, deferred=deferred,
        pending=jnp.where(committed, last, lp.pending),
        out=kv_lib.write_rows(lp.out, v.new_tokens, lp.num_new),
        num_new=lp.num_new + counts, done=lp.done | finished, stats=st,
        backoff=draft_policy.update(lp.backoff, drafted=active & (num_stages > 0),
                                    accepted=jnp.where(active, v.num_accepted, 0),
                                    max_skip=x.max_skip),
        round=lp.round + 1)
