"""One decoding round with a draft tree, and DLoop over trees.

Per round, for every row (rows are independent):

    draft   stage 1: the top B prefixes after the pending token x_n, as a
            tree hanging from the root x_n (`tree.select`). A parallel
            drafter gives per-position distributions q_1..q_gamma (DDTree:
            the prefixes scored prod q_i, `tree.beam`); EAGLE-3 grows a
            dynamic tree (EAGLE-2: per depth, one drafter forward over the
            best frontier nodes, their top children scored by path
            probability) and hands over its scored prefixes.
            dloop: while the best path's stage confidence passes the gate
            (and fewer than S_max stages), stage s+1 is drafted from the end
            of stage s's best path (the best-scoring prefix of full depth) and
            its top-B tree hangs from that node. A stage that continues keeps
            its best path in gamma node slots of its own beside its top B
            (`tree.select`): the path never displaces a better node, so the
            tree of a DLoop round holds the tree of an `sd` round.
    verify  ONE target forward over [x_n, nodes...] of width
            1 + s * B + (s - 1) * gamma (`max_nodes`; a `lax.switch` over
            s = 1..S_max, the most stages any row drafted),
            positions n + depth, ancestor-only attention among the nodes, the
            committed cache fully visible.
    accept  the walk (`tree.walk`): from the root follow the child carrying
            the target's own token (argmax, or a sample of the processed
            target distribution at that node); k nodes, then the target's token
            at the last one (the bonus).
    compact the keys / values of the root and the k path nodes are written to
            the cache contiguously at slots n .. n + k (their RoPE positions
            were already n + depth); then the round ends like a chain round
            (`finish`): the drafter reads the same path.

The best path of a stage scores its log q: for per-position distributions
sum_i max log q_i, the chain drafter's stage confidence (the gate's score is
unchanged by trees). Whether a stage's tree must keep its best path is known
when it is built (the gate is read first).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import deferred as deferred_lib
from dloop_jax.decoding import draft_policy
from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models.transformer import Transformer


@struct.dataclass
class Drafted:
  """The drafted tree of every row.

  Attributes:
    tree: [B, N] nodes of every stage (N = `max_nodes(...)[-1]`), ordered by path score
      (`tree.by_score`: any first b nodes form a tree), padding last.
    num_stages: [B] stages drafted.
  """

  tree: tree_lib.Tree
  num_stages: jax.Array


def stage_slots(*, budget: int, block_size: int, max_stages: int, dloop: bool) -> int:
  """Node slots of one stage: B, and gamma more for the best path where a stage may continue."""
  return budget + block_size if dloop and max_stages > 1 else budget


def max_nodes(*, budget: int, block_size: int, max_stages: int, dloop: bool) -> tuple[int, ...]:
  """The most nodes a round holds after s = 1..S_max stages: s * B + (s - 1) * gamma.

  Each stage but the last continued, so it kept its best path beside its top B.
  """
  path = block_size if dloop else 0
  return tuple(s * budget + (s - 1) * path for s in range(1, max_stages + 1))


def draft(drafter, state, *, going: jax.Array, gate: gate_lib.Gate, dloop: bool, block_size: int,
          max_stages: int, budget: int) -> tuple[Any, Drafted]:
  """Gated tree drafting: stage s + 1 grows from the end of stage s's best path.

  Args:
    drafter: a drafter with `supports_trees`.
    state: its state after the last commit.
    going: [B] rows that draft this round.
    gate: DLoop's gate (`gate.Gate`; only with `dloop`).
    block_size: gamma.
    max_stages: S_max (1 for sd).
    budget: B, nodes per stage.
  """
  b = going.shape[0]
  slots = stage_slots(budget=budget, block_size=block_size, max_stages=max_stages, dloop=dloop)
  n = max_stages * slots
  empty = tree_lib.Tree(
      tokens=jnp.zeros((b, n), jnp.int32), parents=jnp.full((b, n), tree_lib.NO_PARENT, jnp.int32),
      depths=jnp.zeros((b, n), jnp.int32), scores=jnp.full((b, n), -jnp.inf, jnp.float32),
      valid=jnp.zeros((b, n), bool))
  no_node = jnp.full((b,), tree_lib.NO_PARENT, jnp.int32)
  zeros = jnp.zeros((b,), jnp.int32)

  def cond(c):
    stage, _, _, _, going, _, _, _, _ = c
    return (stage < max_stages) & jnp.any(going)

  def body(c):
    stage, dstate, tree, num_stages, going, end, end_depth, end_score, outlook = c
    dstate, ts = drafter.draft_tree_stage(dstate, block_size=block_size, budget=budget)
    cands = (ts.candidates if ts.candidates is not None
             else tree_lib.beam(ts.logprobs,
                                width=tree_lib.beam_width(budget, keeps_path=slots > budget)))
    if dloop:
      # The best path's log q: the chain's stage confidence for marginals
      # (sum of the per-position maxima). The calibrated rule reads it as a
      # chain's: the tree's other paths only add to what it expects.
      more, outlook = gate_lib.decide(gate, outlook, score=cands.best_score, learned_score=None,
                                      stages_done=stage + 1, max_stages=max_stages)
      more = going & more
    else:
      more = jnp.zeros_like(going)
    t, best_end = tree_lib.select(cands, budget=budget,
                                  keep_best_path=more if slots > budget else None)
    if ts.vocab is not None:
      t = t.replace(tokens=ts.vocab[t.tokens])
    offset = stage * slots
    t = tree_lib.attach(t, offset=offset, parent=end, depth=end_depth, active=going,
                        score=end_score)
    tree = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, offset, 1),
                        tree, t)
    end = jnp.where(more, best_end + offset, end)
    end_depth = jnp.where(more, end_depth + block_size, end_depth)
    end_score = jnp.where(more, end_score + cands.best_score, end_score)
    return stage + 1, dstate, tree, num_stages + going, more, end, end_depth, end_score, outlook

  _, state, tree, num_stages, _, _, _, _, _ = jax.lax.while_loop(
      cond, body, (jnp.zeros((), jnp.int32), state, empty, zeros, going, no_node, zeros,
                   jnp.zeros((b,), jnp.float32), gate_lib.Outlook.start(b)))
  # The last stage never continues: its path slots are padding.
  most = max_nodes(budget=budget, block_size=block_size, max_stages=max_stages, dloop=dloop)[-1]
  tree = jax.tree.map(lambda x: x[:, :most], tree)
  return state, Drafted(tree=tree_lib.by_score(tree), num_stages=num_stages)


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, T, ...] at index [B, P] along axis 1 -> [B, P, ...]."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def verify(*, target: Transformer, taps: tuple[int, ...], cache: kv_lib.KVCache,
           pending: jax.Array, tree: tree_lib.Tree, num_verified: jax.Array, branch: jax.Array,
           widths: tuple[int, ...], block_size: int, max_stages: int,
           sampling: sampling_lib.SamplingConfig, key: jax.Array) -> finish_lib.Verified:
  """One target forward over [pending, the first nodes...], the walk, and the compaction.

  Args:
    tree: [B, N] nodes ordered by path score (`tree.by_score`).
    num_verified: [B] nodes each row verifies: its first ones (a tree).
    branch: scalar index into `widths`: the forward reads [pending, nodes
      0 .. widths[branch] - 2], which holds every row's verified nodes.
    widths: the compiled widths (static), 1 + node counts.
  """
  tree = tree_lib.first_nodes(tree, num_verified)
  depth = max_stages * block_size
  mask = tree_lib.ancestor_mask(tree, max_depth=depth)  # [B, 1 + N, 1 + N]
  tokens = jnp.concatenate([pending[:, None], tree.tokens], axis=1)
  positions = tree_lib.positions(tree, start=cache.lengths)
  full = tokens.shape[1]

  def pad(x):
    return jnp.pad(x, [(0, 0), (0, full - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

  def branch_fn(w: int):
    def run():
      # Read-only (write_cache=False): the path is written after the walk.
      o = target(tokens[:, :w], positions=positions[:, :w], cache=cache,
                 block_mask=mask[:, :w, :w], taps=taps, write_cache=False)
      chosen = tree_lib.target_tokens(key=key, logits=o.logits, sampling=sampling)
      return (pad(chosen), pad(o.taps), jax.tree.map(pad, o.new_kv),
              jnp.asarray(w, jnp.int32))

    return run

  branches = [branch_fn(w) for w in widths]
  if len(branches) == 1:
    chosen, taps_out, new_kv, width = branches[0]()
  else:
    chosen, taps_out, new_kv, width = jax.lax.switch(branch, branches)
  w = tree_lib.walk(tree, chosen=chosen, mask=mask, max_depth=depth)
  # Compaction: the root and the path, in order, at slots n .. n + D.
  path_kv = jax.tree.map(lambda x: _gather(x, w.path), new_kv)
  return finish_lib.Verified(cache=cache.append(path_kv), num_accepted=w.num_accepted,
                             new_tokens=w.new_tokens, tokens=_gather(tokens, w.path),
                             taps=_gather(taps_out, w.path), width=width)


def node_confidence(tree: tree_lib.Tree) -> jax.Array:
  """[B, N] c_i with prod_{k <= i} c_k = q(node i's path), for nodes ordered by score.

  Then the scheduler's E(b) = 1 + sum_{i <= b} prod_{k <= i} c_k is
  1 + sum_{i <= b} q(path_i): the expected accepted nodes of the first b
  nodes, were the drafter's path probabilities calibrated, plus the bonus.
  """
  prev = jnp.concatenate([jnp.zeros_like(tree.scores[:, :1]), tree.scores[:, :-1]], axis=1)
  return jnp.where(tree.valid, jnp.exp(tree.scores - jnp.where(tree.valid, prev, 0.0)), 0.0)


def run_round(lp, *, target: Transformer, drafter, mode: str, block_size: int, max_stages: int,
              budget: int, sampling: sampling_lib.SamplingConfig, max_new_tokens: jax.Array,
              key: jax.Array, gate: gate_lib.Gate, stop: jax.Array, max_skip: jax.Array,
              schedule: str, widths: tuple[int, ...], costs: jax.Array):
  """One tree round on the engine's loop state `lp` (see `engine._Loop`).

  schedule="off" verifies every node; "cost" the first b nodes by path score
  (a tree), b from the compiled `widths` maximising E(b) / cost(1 + b)
  (`schedule.choose` with `node_confidence`; b = 0 is a plain step). Which
  nodes are verified depends on the drafter alone, never on the target's
  tokens, so the walk stays lossless for sampling too.
  """
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
  nodes = jnp.sum(drafted.tree.valid, axis=1).astype(jnp.int32)
  if schedule == "cost":
    choice = schedule_lib.choose(confidence=node_confidence(drafted.tree), num_drafts=nodes,
                                 active=active, widths=widths, costs=costs, causal=False)
  else:
    choice = schedule_lib.verify_all(num_drafts=nodes, active=active, widths=widths)
  v = verify(target=target, taps=drafter.taps, cache=lp.cache, pending=lp.pending,
             tree=drafted.tree, num_verified=choice.num_verified, branch=choice.branch,
             widths=widths, block_size=block_size, max_stages=max_stages, sampling=sampling,
             key=round_key)
  return finish_lib.finish_round(
      lp, v=v, drafter=drafter, drafter_state=dstate, deferred=deferred, caught_up=caught_up,
      num_stages=drafted.num_stages, num_drafted=nodes, num_verified=choice.num_verified,
      block_size=block_size, max_stages=max_stages, max_new_tokens=max_new_tokens, stop=stop,
      max_skip=max_skip)
