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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.decoding import verify as verify_lib
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.decoding.proposal import Proposal
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


def stage_slots(*, budget: int, block_size: int, max_stages: int) -> int:
  """Node slots of one stage: B, and gamma more for the best path where a stage may continue."""
  return budget + block_size if max_stages > 1 else budget


def max_nodes(*, budget: int, block_size: int, max_stages: int) -> tuple[int, ...]:
  """The most nodes a round holds after s = 1..S_max stages: s * B + (s - 1) * gamma.

  Each stage but the last continued, so it kept its best path beside its top B.
  """
  return tuple(s * budget + (s - 1) * block_size for s in range(1, max_stages + 1))


def draft(drafter, state, *, going: jax.Array, gate: gate_lib.Gate, block_size: int,
          max_stages: int, budget: int) -> tuple[Any, Drafted]:
  """Gated tree drafting: stage s + 1 grows from the end of stage s's best path.

  Args:
    drafter: a drafter with `supports_trees`.
    state: its state after the last commit.
    going: [B] rows that draft this round.
    gate: DLoop's gate (`gate.Gate`; read when S_max > 1).
    block_size: gamma.
    max_stages: S_max (1: one stage, "sd").
    budget: B, nodes per stage.
  """
  b = going.shape[0]
  slots = stage_slots(budget=budget, block_size=block_size, max_stages=max_stages)
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
    if max_stages > 1:
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
  most = max_nodes(budget=budget, block_size=block_size, max_stages=max_stages)[-1]
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

  def forward(w: int):
    # Read-only (write_cache=False): the path is written after the walk.
    o = target(tokens[:, :w], positions=positions[:, :w], cache=cache,
               block_mask=mask[:, :w, :w], taps=taps, write_cache=False)
    chosen = tree_lib.target_tokens(key=key, logits=o.logits, sampling=sampling)
    return (chosen, o.taps, o.new_kv), ()

  (chosen, taps_out, new_kv), _, width = verify_lib.at_width(
      forward, branch=branch, widths=widths, pad_to=tokens.shape[1])
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeProposer:
  """A draft tree per stage (`proposal.Proposer`; the module docstring).

  Attributes:
    target, drafter: the models (the drafter `supports_trees`).
    block_size: gamma.
    max_stages: S_max (1: one stage, no gate).
    budget: B, nodes per stage.
    sampling: the sampling configuration.
    gate: DLoop's gate.
  """

  target: Transformer
  drafter: Drafter
  block_size: int
  max_stages: int
  budget: int
  sampling: sampling_lib.SamplingConfig
  gate: gate_lib.Gate

  @property
  def causal(self) -> bool:
    # Which nodes are verified depends on the drafter alone, never on the
    # target's tokens, so the walk stays lossless for sampling too.
    return False

  def propose(self, drafter_state: Any, *, going: jax.Array, key: jax.Array,
              lookup: lookup_lib.Proposal | None) -> tuple[Any, Proposal]:
    del key  # the tree holds the top prefixes: nothing is sampled
    assert lookup is None, "the prompt lookup drafts chains"
    drafter_state, drafted = draft(self.drafter, drafter_state, going=going, gate=self.gate,
                                   block_size=self.block_size, max_stages=self.max_stages,
                                   budget=self.budget)
    nodes = jnp.sum(drafted.tree.valid, axis=1).astype(jnp.int32)
    return drafter_state, Proposal(drafts=drafted.tree, confidence=node_confidence(drafted.tree),
                                   num_drafts=nodes, num_stages=drafted.num_stages,
                                   looked_up=jnp.zeros_like(going))

  def verify(self, proposal: Proposal, *, cache: kv_lib.KVCache, pending: jax.Array,
             choice: schedule_lib.Choice, widths: tuple[int, ...],
             key: jax.Array) -> finish_lib.Verified:
    """schedule "off" verifies every node; "cost" the first b by path score (a tree)."""
    return verify(target=self.target, taps=self.drafter.taps, cache=cache, pending=pending,
                  tree=proposal.drafts, num_verified=choice.num_verified, branch=choice.branch,
                  widths=widths, block_size=self.block_size, max_stages=self.max_stages,
                  sampling=self.sampling, key=key)
