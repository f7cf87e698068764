"""One decoding round with a draft tree (DDTree), and DLoop over trees.

Per round, for every row (rows are independent):

    draft   stage 1: the drafter's per-position distributions q_1..q_gamma
            after the pending token x_n -> a tree of the top B prefixes
            (`tree.build`; or of the drafter's own beams, `tree.prune`:
            DARTree), hanging from the root x_n.
            dloop: while the best path's stage confidence passes the gate
            (and fewer than S_max stages), stage s+1 is drafted from the end
            of stage s's best path (the argmax token at every position; it is
            kept in stage s's tree) and its top-B tree hangs from that node.
    verify  ONE target forward over [x_n, nodes...] of width 1 + s * B
            (a `lax.switch` over s = 1..S_max, the most stages any row drafted),
            positions n + depth, ancestor-only attention among the nodes, the
            committed cache fully visible.
    accept  the walk (`tree.walk`): from the root follow the child carrying
            the target's own token (argmax, or a sample of the processed
            target distribution at that node); k nodes, then the target's token
            at the last one (the bonus).
    compact the keys / values of the root and the k path nodes are written to
            the cache contiguously at slots n .. n + k (their RoPE positions
            were already n + depth), and the drafter commits the same path.

The best path of a stage scores sum_i max log q_i: the chain drafter's stage
confidence (the gate's score is unchanged by trees). Whether a stage's tree
must keep its best path is known when it is built (the gate is read first).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import draft_policy
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models.transformer import Transformer


@struct.dataclass
class Drafted:
  """The drafted tree of every row.

  Attributes:
    tree: [B, S_max * budget] nodes; stage s's nodes sit at slots
      s * budget .. (s + 1) * budget - 1 (padding where the row did not draft it).
    num_stages: [B] stages drafted.
  """

  tree: tree_lib.Tree
  num_stages: jax.Array


def draft(drafter, state, *, going: jax.Array, gate: jax.Array, dloop: bool, block_size: int,
          max_stages: int, budget: int) -> tuple[Any, Drafted]:
  """Gated tree drafting: stage s + 1 grows from the end of stage s's best path.

  Args:
    drafter: a drafter with `supports_trees`.
    state: its state after the last commit.
    going: [B] rows that draft this round.
    gate: DLoop's g (only with `dloop`).
    block_size: gamma.
    max_stages: S_max (1 for sd).
    budget: B, nodes per stage.
  """
  b = going.shape[0]
  n = max_stages * budget
  empty = tree_lib.Tree(
      tokens=jnp.zeros((b, n), jnp.int32), parents=jnp.full((b, n), tree_lib.NO_PARENT, jnp.int32),
      depths=jnp.zeros((b, n), jnp.int32), scores=jnp.full((b, n), -jnp.inf, jnp.float32),
      valid=jnp.zeros((b, n), bool))
  no_node = jnp.full((b,), tree_lib.NO_PARENT, jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)

  def cond(c):
    stage, _, _, _, going, _, _ = c
    return (stage < max_stages) & jnp.any(going)

  def body(c):
    stage, dstate, tree, num_stages, going, end, end_depth = c
    dstate, ts = drafter.draft_tree_stage(dstate, block_size=block_size)
    best = jnp.max(ts.logprobs, axis=-1)  # [B, gamma]
    if dloop:
      more = going & gate_lib.continue_drafting(
          gate_lib.stage_confidence(best), gate=gate, stages_done=stage + 1,
          max_stages=max_stages)
    else:
      more = jnp.zeros_like(going)
    if ts.beams is not None:  # the drafter grew path-dependent beams (DARTree)
      t, best_end = tree_lib.prune(ts.beams, budget=budget, keep_best_path=more)
    else:
      t, best_end = tree_lib.build(ts.logprobs, budget=budget, keep_best_path=more)
    if ts.vocab is not None:
      t = t.replace(tokens=ts.vocab[t.tokens])
    offset = stage * budget
    t = tree_lib.attach(t, offset=offset, parent=end, depth=end_depth, active=going)
    tree = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, offset, 1),
                        tree, t)
    end = jnp.where(more, best_end + offset, end)
    end_depth = jnp.where(more, end_depth + block_size, end_depth)
    return stage + 1, dstate, tree, num_stages + going, more, end, end_depth

  _, state, tree, num_stages, _, _, _ = jax.lax.while_loop(
      cond, body, (jnp.zeros((), jnp.int32), state, empty, zeros, going, no_node, zeros))
  return state, Drafted(tree=tree, num_stages=num_stages)


@struct.dataclass
class Verified:
  """One tree verification, compacted.

  Attributes:
    cache: the target cache with [root, path...] written at slots n .. n + D
      (lengths still to be set by the caller).
    num_accepted: [B] k.
    new_tokens: [B, D + 1] the accepted path's tokens, then the bonus.
    tokens: [B, D + 1] what the target read along the path: x_n, path tokens.
    taps: [B, D + 1, n_taps, Dm] target taps along the path.
    width: scalar, the width of the forward that ran.
  """

  cache: kv_lib.KVCache
  num_accepted: jax.Array
  new_tokens: jax.Array
  tokens: jax.Array
  taps: jax.Array
  width: jax.Array


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, T, ...] at index [B, P] along axis 1 -> [B, P, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def verify(*, target: Transformer, taps: tuple[int, ...], cache: kv_lib.KVCache,
           pending: jax.Array, drafted: Drafted, block_size: int, max_stages: int, budget: int,
           sampling: sampling_lib.SamplingConfig, key: jax.Array) -> Verified:
  """One target forward over [pending, nodes...], the walk, and the compaction."""
  tree = drafted.tree
  depth = max_stages * block_size
  mask = tree_lib.ancestor_mask(tree, max_depth=depth)  # [B, 1 + N, 1 + N]
  tokens = jnp.concatenate([pending[:, None], tree.tokens], axis=1)
  positions = tree_lib.positions(tree, start=cache.lengths)
  full = tokens.shape[1]

  def pad(x):
    return jnp.pad(x, [(0, 0), (0, full - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

  def branch_fn(stages: int):
    w = 1 + stages * budget

    def run():
      # Read-only (write_cache=False): the path is written after the walk.
      o = target(tokens[:, :w], positions=positions[:, :w], cache=cache,
                 block_mask=mask[:, :w, :w], taps=taps, write_cache=False)
      chosen = tree_lib.target_tokens(key=key, logits=o.logits, sampling=sampling)
      return (pad(chosen), pad(o.taps), jax.tree.map(pad, o.new_kv),
              jnp.asarray(w, jnp.int32))

    return run

  # Nodes of stages no row drafted are padding in every row: the narrowest
  # forward that holds every row's tree suffices.
  branch = jnp.clip(jnp.max(drafted.num_stages) - 1, 0, max_stages - 1)
  branches = [branch_fn(s) for s in range(1, max_stages + 1)]
  if len(branches) == 1:
    chosen, taps_out, new_kv, width = branches[0]()
  else:
    chosen, taps_out, new_kv, width = jax.lax.switch(branch, branches)
  w = tree_lib.walk(tree, chosen=chosen, mask=mask, max_depth=depth)
  # Compaction: the root and the path, in order, at slots n .. n + D.
  path_kv = jax.tree.map(lambda x: _gather(x, w.path), new_kv)
  return Verified(cache=cache.append(path_kv), num_accepted=w.num_accepted,
                  new_tokens=w.new_tokens, tokens=_gather(tokens, w.path),
                  taps=_gather(taps_out, w.path), width=width)


def run_round(lp, *, target: Transformer, drafter, mode: str, block_size: int, max_stages: int,
              budget: int, sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
              key: jax.Array, gate: jax.Array, stop: jax.Array, max_skip: jax.Array,
              commit_counts: Callable):
  """One tree round on the engine's loop state `lp` (see `engine._Loop`)."""
  active = ~lp.done
  starts = lp.cache.lengths
  round_key = jax.random.fold_in(key, lp.round)
  going = draft_policy.wants_draft(lp.backoff, active=active)
  # The drafter first reads the tokens of the pause before this round, if any.
  dstate, deferred, caught_up = deferred_lib.flush(
      lp.deferred, drafter=drafter, drafter_state=lp.drafter_state, committed_length=starts)
  dstate, drafted = draft(drafter, dstate, going=going, gate=gate,
                          dloop=mode == "dloop", block_size=block_size, max_stages=max_stages,
                          budget=budget)
  v = verify(target=target, taps=drafter.taps, cache=lp.cache, pending=lp.pending,
             drafted=drafted, block_size=block_size, max_stages=max_stages, budget=budget,
             sampling=sampling, key=round_key)

  counts, finished = commit_counts(
      new_tokens=v.new_tokens, num_valid=jnp.where(active, v.num_accepted + 1, 0),
      num_new=lp.num_new, max_new_tokens=max_new_tokens, stop=stop)
  committed = counts > 0
  last = jnp.take_along_axis(v.new_tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
  dstate = drafter.commit(dstate, tokens=v.tokens, features=v.taps, next_tokens=v.new_tokens,
                          starts=starts, counts=counts)
  num_stages = drafted.num_stages
  nodes = jnp.sum(drafted.tree.valid, axis=1).astype(jnp.int32)
  st = lp.stats
  act = active.astype(jnp.int32)
  st = st.replace(
      rounds=st.rounds + act,
      committed=st.committed + counts,
      drafted=st.drafted + act * nodes,
      verified=st.verified + act * nodes,
      plain_rounds=st.plain_rounds + act * (nodes == 0),
      accepted=st.accepted + jnp.minimum(v.num_accepted, counts),
      drafter_forwards=st.drafter_forwards + act * (
          drafter.drafting_forwards(block_size, num_stages) + 1) + caught_up,
      target_tokens=st.target_tokens + act * v.width,
      stage_hist=st.stage_hist + act[:, None] * jax.nn.one_hot(
          num_stages, max_stages + 1, dtype=jnp.int32))
  return lp.replace(
      cache=v.cache.with_lengths(jnp.where(committed, starts + counts, starts)),
      drafter_state=dstate, deferred=deferred,
      pending=jnp.where(committed, last, lp.pending),
      out=kv_lib.write_rows(lp.out, v.new_tokens, lp.num_new),
      num_new=lp.num_new + counts, done=lp.done | finished, stats=st,
      backoff=draft_policy.update(lp.backoff, drafted=active & (num_stages > 0),
                                  accepted=jnp.where(active, v.num_accepted, 0),
                                  max_skip=max_skip),
      round=lp.round + 1)
