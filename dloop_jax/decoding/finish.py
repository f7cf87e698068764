"""The end of a speculative round: commit what the verification accepted.

Chain rounds (`engine`) and tree rounds (`tree_round`) differ in what they draft
and how they verify; both end with a `Verified` (the accepted tokens and what
the target read along them, compacted to a chain) and the same steps:

    counts   tokens each row commits: the k accepted drafts and the bonus,
             cut at a stop token or at max_new_tokens (`commit_counts`)
    caches   the target cache's length becomes n + counts; the drafter reads
             the committed tokens now if some row accepted a draft, else the
             next drafting round reads them (`deferred`)
    stats    per-row counters of the round
    state    pending token, output buffer, done flags, drafting back-off
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import draft_policy
from dloop_jax.models import kv_cache as kv_lib


def commit_counts(*, new_tokens: jax.Array, num_valid: jax.Array, num_new: jax.Array,
                  max_new_tokens: jax.Array, stop: jax.Array) -> tuple[jax.Array, jax.Array]:
  """How many of `new_tokens` each row commits, and whether it finishes.

  A stop token is committed and ends the row; so does reaching max_new_tokens
  (possibly in the middle of an accepted block).

  Args:
    new_tokens: [B, W] candidate tokens in order.
    num_valid: [B] how many of them are valid.
    num_new: [B] tokens the row generated so far.
    max_new_tokens: the row limit (a traced scalar).
    stop: [K] stop token ids, padded with -1 (matches no token).

  Returns:
    counts [B], finished [B].
  """
  w = new_tokens.shape[1]
  t = jnp.arange(w)[None, :]
  valid = t < num_valid[:, None]
  hit = valid & jnp.isin(new_tokens, stop)
  first_stop = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), w)
  counts = jnp.minimum(num_valid, first_stop + 1)
  counts = jnp.minimum(counts, max_new_tokens - num_new)
  counts = jnp.maximum(counts, 0)
  finished = (num_valid > 0) & ((first_stop < counts) | (num_new + counts >= max_new_tokens))
  return counts, finished


@struct.dataclass
class Verified:
  """One verification forward and its acceptance, as a chain (per row).

  Attributes:
    cache: the target cache with the pending token's and the accepted drafts'
      keys / values written at slots n, n + 1, ... (lengths still to be set).
    num_accepted: [B] drafts accepted, k.
    new_tokens: [B, W] d_1..d_k, then the bonus token; padding after.
    tokens: [B, W] what the target read along them: pending token, d_1.., pad.
    taps: [B, W, n_taps, D] target taps at those positions.
    width: scalar, the width of the forward that ran.
  """

  cache: kv_lib.KVCache
  num_accepted: jax.Array
  new_tokens: jax.Array
  tokens: jax.Array
  taps: jax.Array
  width: jax.Array


def finish_round(lp, *, v: Verified, drafter, drafter_state: Any,
                 deferred: deferred_lib.Deferred, caught_up: jax.Array, num_stages: jax.Array,
                 num_drafted: jax.Array, num_verified: jax.Array, block_size: int,
                 max_stages: int, max_new_tokens: jax.Array, stop: jax.Array, max_skip: jax.Array):
  """Commits a verified round on the engine's loop state `lp` (see `engine._Loop`).

  Args:
    lp: the loop state before the round.
    v: the verification.
    drafter, drafter_state: the drafter and its state after drafting.
    deferred: the drafter's unread memory after the round's flush.
    caught_up: [B] rows whose memory the round's flush read (one forward each).
    num_stages: [B] stages drafted.
    num_drafted: [B] drafts (chain) or tree nodes drafted.
    num_verified: [B] of them verified.
    block_size: gamma.
    max_stages: S_max.
    max_new_tokens: the row limit.
    stop: [n_stop] stop token ids, padded with -1.
    max_skip: the longest drafting pause (`draft_policy`).

  Returns:
    The loop state after the round.
  """
  active = ~lp.done
  starts = lp.cache.lengths
  counts, finished = commit_counts(
      new_tokens=v.new_tokens, num_valid=jnp.where(active, v.num_accepted + 1, 0),
      num_new=lp.num_new, max_new_tokens=max_new_tokens, stop=stop)
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
  st = lp.stats
  act = active.astype(jnp.int32)
  st = st.replace(
      rounds=st.rounds + act,
      committed_in_rounds=st.committed_in_rounds + counts,
      drafted=st.drafted + act * num_drafted,
      verified=st.verified + act * num_verified,
      plain_rounds=st.plain_rounds + act * (num_verified == 0),
      accepted=st.accepted + jnp.minimum(v.num_accepted, counts),
      # Drafting, the commit if it ran now, and the commit of what the drafter
      # had not read before the round, if any (see `decoding.drafter`).
      drafter_forwards=st.drafter_forwards + act * (
          drafter.drafting_forwards(block_size, num_stages) + read_now) + caught_up,
      target_tokens=st.target_tokens + act * v.width,
      stage_histogram=st.stage_histogram + act[:, None] * jax.nn.one_hot(
          num_stages, max_stages + 1, dtype=jnp.int32))
  return lp.replace(
      cache=v.cache.with_lengths(jnp.where(committed, starts + counts, starts)),
      drafter_state=drafter_state, deferred=deferred,
      pending=jnp.where(committed, last, lp.pending),
      out=kv_lib.write_rows(lp.out, v.new_tokens, lp.num_new),
      num_new=lp.num_new + counts, done=lp.done | finished, stats=st,
      backoff=draft_policy.update(lp.backoff, drafted=active & (num_stages > 0),
                                  accepted=jnp.where(active, v.num_accepted, 0),
                                  max_skip=max_skip),
      round=lp.round + 1)
