"""Draft trees (DDTree): top-B prefixes of a block's per-position draft distributions.

A parallel drafter gives, for the next gamma positions, distributions
q_1 .. q_gamma that do not depend on one another (marginals). A node is a
prefix u = (u_1 .. u_d) with score q(u) = prod_i q_i(u_i); the root (the last
committed token) is not a node. Taking the B best-scoring prefixes is optimal
for a budget of B nodes, and it is prefix-closed: a prefix scores at least as
much as any of its extensions (log-probs are <= 0).

Static shapes. Every row holds N node slots; a slot is `valid` or padding.
Nodes come parents-first (a node's parent has a smaller index), so a node's
ancestors can be found by walking parent links, and the verify forward can
read the nodes in slot order with an ancestor-only attention mask.

Exact top-B without a heap: per depth d keep the B best prefixes of depth d
(a beam over the top-K tokens of position d, K = min(B, V)), then take the B
best of all gamma * B kept prefixes. A prefix outside its depth's top B has B
better prefixes of the same depth, so it cannot be in the global top B; a
depth-d prefix in its depth's top B has its parent in depth d-1's top B (every
better parent extends to a better child with the same last token). Ties are
broken towards the smaller candidate index, and candidates are numbered depth
first (index = (d - 1) * B + beam slot), so a parent always ranks before its
children: the selection is prefix-closed even at ties.

The two steps are apart: `beam` (the per-depth beams, `Candidates`) and
`select` (the global top B). A drafter whose distributions depend on the path
(EAGLE-3's dynamic tree) builds its own beam and hands it to `select`.
`by_score` orders a tree's nodes best first, so that any first b of them form
a tree (the cost-scheduled verification of part of a tree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib

NO_PARENT = -1  # the parent of depth-1 nodes: the root


@struct.dataclass
class Tree:
  """Draft tree nodes of every row (root excluded).

  Attributes:
    tokens: [R, N] int32 token of each node (0 for padding).
    parents: [R, N] int32 parent node index, NO_PARENT for children of the root.
    depths: [R, N] int32 depth >= 1 (the root is at depth 0); 0 for padding.
    scores: [R, N] f32 log q(prefix) (-inf for padding).
    valid: [R, N] bool.
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  scores: jax.Array
  valid: jax.Array

  @property
  def num_nodes(self) -> int:
    return self.tokens.shape[1]


@struct.dataclass
class Candidates:
  """A beam over the depths of one stage: the prefixes a tree is selected from.

  Per depth d = 1..D, W prefixes sorted by score (best first). Drafters that
  score prefixes themselves (EAGLE-3's dynamic tree) produce it directly;
  `beam` produces it from a parallel drafter's per-position distributions.

  Attributes:
    tokens: [R, D, W] int32 last token of each prefix.
    scores: [R, D, W] f32 log q(prefix), non-increasing along W (-inf: padding).
    parents: [R, D, W] int32 beam slot of the prefix's parent at depth d - 1
      (ignored at depth 1: the root).
    best: [R, D, W] bool, the prefixes of the stage's best path: the
      best-scoring prefix of depth D (slot 0 there) and its ancestors.
  """

  tokens: jax.Array
  scores: jax.Array
  parents: jax.Array
  best: jax.Array

  @property
  def best_score(self) -> jax.Array:
    """[R] log q of the best path: the stage confidence the DLoop gate reads."""
    return self.scores[:, -1, 0]


def beam(logprobs: jax.Array, *, width: int) -> Candidates:
  """Per depth, the `width` best prefixes of per-position (marginal) distributions.

  Exact: a depth-d prefix among the `width` best of its depth extends a parent
  among the `width` best of depth d - 1 (module docstring).

  Args:
    logprobs: [R, gamma, V] log q_i over the drafter's vocabulary (tokens are
      column indices of it).
    width: W (static).
  """
  r, gamma, v = logprobs.shape
  b = width
  k = min(b, v)
  top_lp, top_ids = jax.lax.top_k(logprobs.astype(jnp.float32), k)  # [R, gamma, K], sorted
  neg_inf = jnp.float32(-jnp.inf)

  # Depth 1: the K best tokens, padded to B.
  score = jnp.pad(top_lp[:, 0], ((0, 0), (0, b - k)), constant_values=neg_inf)  # [R, B]
  token = jnp.pad(top_ids[:, 0], ((0, 0), (0, b - k)))
  parent = jnp.full((r, b), NO_PARENT, jnp.int32)
  # The best path is beam slot 0 at every depth: it scores highest and, at a
  # tie, has the smallest candidate index (parent slot 0, token rank 0).
  best = jnp.broadcast_to(jnp.arange(b) == 0, (r, b))
  scores, tokens, parents, bests = [score], [token], [parent], [best]
  for d in range(1, gamma):
    cand = score[:, :, None] + top_lp[:, d][:, None, :]  # [R, B, K]
    score, flat = jax.lax.top_k(cand.reshape(r, b * k), b)
    parent = (flat // k).astype(jnp.int32)
    rank = flat % k
    token = jnp.take_along_axis(top_ids[:, d], rank, axis=1)
    best = jnp.take_along_axis(best, parent, axis=1) & (rank == 0)
    scores.append(score)
    tokens.append(token)
    parents.append(parent)
    bests.append(best)
  return Candidates(tokens=jnp.stack(tokens, axis=1).astype(jnp.int32),
                    scores=jnp.stack(scores, axis=1), parents=jnp.stack(parents, axis=1),
                    best=jnp.stack(bests, axis=1))


def beam_width(budget: int, *, keeps_path: bool) -> int:
  """Prefixes per depth a beam needs for `select(budget=B)`: B, and one more where
  the best path may be kept, so that the B best others of a depth are in it
  whatever the path takes."""
  return budget + 1 if keeps_path else budget


def select(cands: Candidates, *, budget: int,
           keep_best_path: jax.Array | None = None) -> tuple[Tree, jax.Array]:
  """The `budget` best prefixes of a beam, as a prefix-closed tree.

  Args:
    cands: R rows of D depths of W prefixes.
    budget: B, nodes per row (static); with fewer than B candidates the rest
      is padding.
    keep_best_path: optional [R] bool: rows whose best path (`cands.best`)
      must be in the tree, whatever it scores (a DLoop stage continues from
      its end). The tree then has B + D node slots: in those rows the D
      nodes of the path and the B best other prefixes (a superset of the
      top B: the path never displaces a better node), in the other rows the
      top B and D slots of padding. The path is prefix-closed and every other
      node's parent is either on it or outscores the node, so the tree stays
      prefix-closed.

  Returns:
    The tree (N = B, or B + D with `keep_best_path`; parents-first) and
    best_end [R]: the node index of the best path's depth-D node, or
    NO_PARENT where it is not in the tree.
  """
  r, depth, w = cands.scores.shape
  n_cand = depth * w
  slots = budget if keep_best_path is None else budget + depth
  m = min(slots, n_cand)
  neg_inf = jnp.float32(-jnp.inf)
  # Candidates numbered depth-major (index = (d - 1) * W + slot): a parent
  # always has a smaller index than its children, so ties keep prefixes closed.
  all_scores = cands.scores.reshape(r, n_cand)
  key = all_scores
  if keep_best_path is not None:
    key = jnp.where(cands.best.reshape(r, n_cand) & keep_best_path[:, None], jnp.inf, all_scores)
  _, chosen = jax.lax.top_k(key, m)
  # Sorted, parents come first; padding goes last.
  padding = jnp.take_along_axis(all_scores, chosen, axis=1) == neg_inf
  if keep_best_path is not None:
    # Rows that do not keep the path take the top B only (top_k ranks best first).
    padding |= (jnp.arange(m)[None, :] >= budget) & ~keep_best_path[:, None]
  chosen = jnp.sort(chosen + jnp.where(padding, n_cand, 0), axis=1)
  padding = chosen >= n_cand
  chosen = chosen % n_cand
  rows = jnp.arange(r)[:, None]
  # Candidate index -> node index (or NO_PARENT where not chosen).
  node_of = jnp.full((r, n_cand), NO_PARENT, jnp.int32).at[rows, chosen].set(
      jnp.where(padding, NO_PARENT, jnp.arange(m, dtype=jnp.int32)[None, :]))

  depth0 = chosen // w  # depth - 1
  beam_parent = jnp.take_along_axis(cands.parents.reshape(r, n_cand), chosen, axis=1)
  parent_cand = (depth0 - 1) * w + beam_parent
  node_parent = jnp.where(depth0 == 0, NO_PARENT,
                          jnp.take_along_axis(node_of, jnp.maximum(parent_cand, 0), axis=1))
  node_score = jnp.where(padding, neg_inf, jnp.take_along_axis(all_scores, chosen, axis=1))
  valid = node_score > neg_inf
  tree = Tree(
      tokens=jnp.where(valid, jnp.take_along_axis(cands.tokens.reshape(r, n_cand), chosen,
                                                  axis=1), 0).astype(jnp.int32),
      parents=jnp.where(valid, node_parent, NO_PARENT).astype(jnp.int32),
      depths=jnp.where(valid, depth0 + 1, 0).astype(jnp.int32),
      scores=node_score,
      valid=valid)
  if m < slots:
    pad = slots - m
    tree = Tree(tokens=jnp.pad(tree.tokens, ((0, 0), (0, pad))),
                parents=jnp.pad(tree.parents, ((0, 0), (0, pad)), constant_values=NO_PARENT),
                depths=jnp.pad(tree.depths, ((0, 0), (0, pad))),
                scores=jnp.pad(tree.scores, ((0, 0), (0, pad)), constant_values=neg_inf),
                valid=jnp.pad(tree.valid, ((0, 0), (0, pad))))
  best_end = node_of[:, (depth - 1) * w]  # slot 0 of the last depth
  return tree, best_end


def build(logprobs: jax.Array, *, budget: int,
          keep_best_path: jax.Array | None = None) -> tuple[Tree, jax.Array]:
  """The top-`budget` prefixes of per-position draft log-probs (DDTree).

  `select(beam(logprobs, width=budget))`: see both.

  Args:
    logprobs: [R, gamma, V] log q_i over the drafter's vocabulary (node tokens
      are column indices of it).
    budget: B, nodes per row (static).
    keep_best_path: optional [R] bool (`select`): rows whose best full-depth
      path, the argmax token at every position, must be in the tree (then
      B + gamma node slots).

  Returns:
    The tree (parents-first) and best_end [R] (`select`).
  """
  width = beam_width(budget, keeps_path=keep_best_path is not None)
  return select(beam(logprobs, width=width), budget=budget, keep_best_path=keep_best_path)


def concatenate(trees: list[Tree]) -> Tree:
  """Node-wise concatenation of trees whose indices already refer to the result."""
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *trees)


def attach(tree: Tree, *, offset: int, parent: jax.Array, depth: jax.Array,
           active: jax.Array, score: jax.Array | None = None) -> Tree:
  """Re-indexes a tree to live at node slots offset.. under node `parent`.

  Args:
    tree: a tree from `build`.
    offset: where its node 0 goes in the combined tree (an int or a traced scalar).
    parent: [R] combined index of the node its depth-1 nodes hang from
      (NO_PARENT: the root).
    depth: [R] depth of that node (0 for the root).
    active: [R] bool: rows where the tree is kept (others become padding).
    score: [R] log q of that node's path (0 for the root, the default), added
      to the tree's scores: they become log q of the path from the root.
  """
  valid = tree.valid & active[:, None]
  parents = jnp.where(tree.parents == NO_PARENT, parent[:, None], tree.parents + offset)
  scores = tree.scores if score is None else tree.scores + score[:, None]
  return Tree(tokens=jnp.where(valid, tree.tokens, 0),
              parents=jnp.where(valid, parents, NO_PARENT).astype(jnp.int32),
              depths=jnp.where(valid, tree.depths + depth[:, None], 0).astype(jnp.int32),
              scores=jnp.where(valid, scores, -jnp.inf), valid=valid)


def by_score(tree: Tree) -> Tree:
  """The nodes reordered by path score, best first; padding last.

  A node scores at most its parent (log-probs are <= 0) and the parent comes
  first at a tie (the sort is stable and the input is parents-first), so the
  result is parents-first and its first b nodes, for any b, form a
  prefix-closed tree: the best b-node subtree of the drafter's scores.
  """
  order = jnp.argsort(-tree.scores, axis=1, stable=True)
  inverse = jnp.argsort(order, axis=1)

  def take(x):
    return jnp.take_along_axis(x, order, axis=1)

  parents = take(tree.parents)
  parents = jnp.where(parents == NO_PARENT, NO_PARENT,
                      jnp.take_along_axis(inverse, jnp.maximum(parents, 0), axis=1))
  return Tree(tokens=take(tree.tokens), parents=parents.astype(jnp.int32),
              depths=take(tree.depths), scores=take(tree.scores), valid=take(tree.valid))


def first_nodes(tree: Tree, count: jax.Array) -> Tree:
  """Keeps the first `count` [R] nodes of each row (the rest become padding)."""
  valid = tree.valid & (jnp.arange(tree.num_nodes)[None, :] < count[:, None])
  return tree.replace(valid=valid, tokens=jnp.where(valid, tree.tokens, 0),
                      scores=jnp.where(valid, tree.scores, -jnp.inf))


def ancestor_mask(tree: Tree, *, max_depth: int) -> jax.Array:
  """Which of [root, nodes...] each of them attends to: ancestors and itself.

  Index 0 is the root (the pending token), node i is index i + 1. With nodes
  a (child of the root), b (child of a) and c (child of the root):

               root  a  b  c
      root      x    .  .  .
      a         x    x  .  .
      b         x    x  x  .
      c         x    .  .  x

  Padding nodes see the root and themselves. The committed cache is visible to
  all (the forward adds it).

  Args:
    tree: R rows of N nodes.
    max_depth: the deepest node's depth (static): the number of parent hops.

  Returns:
    [R, 1 + N, 1 + N] bool.
  """
  r, n = tree.tokens.shape
  up = jnp.concatenate([jnp.zeros((r, 1), jnp.int32), tree.parents + 1], axis=1)  # [R, 1 + N]
  # reach[i, j]: j is i or its parent (the root has none). Squaring doubles the
  # hops covered: ceil(log2(max_depth)) products reach every ancestor.
  reach = jax.nn.one_hot(up, n + 1, dtype=jnp.float32).at[:, 0, :].set(0)
  reach = jnp.maximum(reach, jnp.eye(n + 1, dtype=jnp.float32))
  hops = 1
  while hops < max_depth:
    reach = jnp.minimum(jnp.einsum("rij,rjk->rik", reach, reach), 1.0)
    hops *= 2
  return reach > 0


def positions(tree: Tree, *, start: jax.Array) -> jax.Array:
  """[R, 1 + N] RoPE positions of [root, nodes...]: start + depth."""
  depths = jnp.concatenate([jnp.zeros_like(tree.depths[:, :1]), tree.depths], axis=1)
  return start[:, None] + depths


@struct.dataclass
class Walk:
  """The accepted path of a tree walk.

  Attributes:
    num_accepted: [R] k, nodes accepted (the path's depth).
    new_tokens: [R, D + 1] the path's tokens, then the bonus at index k.
    path: [R, D + 1] indices into [root, nodes...] of the root and the path
      (entries past k repeat the root: padding).
  """

  num_accepted: jax.Array
  new_tokens: jax.Array
  path: jax.Array


def target_tokens(*, key: jax.Array, logits: jax.Array,
                  sampling: sampling_lib.SamplingConfig) -> jax.Array:
  """The target's own next token at every tree index: argmax, or one independent sample.

  Args:
    logits: [R, 1 + N, V] target logits at [root, nodes...].

  Returns:
    [R, 1 + N] int32.
  """
  return sampling_lib.next_token(key, logits, sampling)


def walk(tree: Tree, *, chosen: jax.Array, mask: jax.Array, max_depth: int) -> Walk:
  """From the root, move to the child whose token is the target's token here.

  The target's token at a node (`chosen`: argmax at temperature 0, a sample
  from the processed target distribution otherwise) is the token the target
  would commit after that node's prefix. If a child carries it, the child is
  accepted and the walk continues there; otherwise the target's token is the
  bonus. Siblings carry distinct tokens, so at most one child matches, and the
  accepted nodes are exactly those whose own token and every ancestor's token
  matched: no sequential loop is needed.

  Lossless for sampling too: every committed token is a draw of the target at
  its prefix, and the tree does not depend on those draws.

  Args:
    tree: R rows of N nodes.
    chosen: [R, 1 + N] the target's token at [root, nodes...].
    mask: [R, 1 + N, 1 + N] `ancestor_mask(tree)`.
    max_depth: D, the deepest possible path (static).
  """
  r, n = tree.tokens.shape
  at_parent = jnp.take_along_axis(chosen, tree.parents + 1, axis=1)  # [R, N]
  match = tree.valid & (tree.tokens == at_parent)
  # A node is accepted if it and all its ancestors (root excluded) match.
  anc = mask[:, 1:, 1:]  # [R, N, N]
  accepted = ~jnp.any(anc & ~match[:, None, :], axis=2)  # [R, N]
  depth = jnp.where(accepted, tree.depths, 0)
  k = jnp.max(depth, axis=1, initial=0).astype(jnp.int32)
  last = jnp.where(k > 0, jnp.argmax(depth, axis=1) + 1, 0)  # [R] index into [root, nodes]
  bonus = jnp.take_along_axis(chosen, last[:, None], axis=1)[:, 0]
  # The accepted node of each depth 1..D (at most one per depth).
  at_depth = accepted[:, None, :] & (tree.depths[:, None, :] == jnp.arange(1, max_depth + 1)[
      None, :, None])  # [R, D, N]
  path_nodes = jnp.where(jnp.any(at_depth, axis=2), jnp.argmax(at_depth, axis=2) + 1, 0)
  path = jnp.concatenate([jnp.zeros((r, 1), jnp.int32), path_nodes.astype(jnp.int32)], axis=1)
  tokens = jnp.concatenate([jnp.zeros((r, 1), jnp.int32), tree.tokens], axis=1)
  path_tokens = jnp.take_along_axis(tokens, path[:, 1:], axis=1)  # [R, D]
  padded = jnp.concatenate([path_tokens, jnp.zeros((r, 1), jnp.int32)], axis=1)
  t = jnp.arange(max_depth + 1)[None, :]
  new_tokens = jnp.where(t == k[:, None], bonus[:, None], jnp.where(t < k[:, None], padded, 0))
  return Walk(num_accepted=k, new_tokens=new_tokens.astype(jnp.int32), path=path)
