"""Draft trees: exact top-B construction, prefix closure, ancestor mask, walk.

Pure functions on small arrays (no engine program is compiled).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dloop_jax.decoding import tree as tree_lib

# Jitted: one small program per shape instead of one per operation.
_build = jax.jit(tree_lib.build, static_argnames="budget")
_mask = jax.jit(tree_lib.ancestor_mask, static_argnames="max_depth")
_walk = jax.jit(tree_lib.walk, static_argnames="max_depth")
_by_score = jax.jit(tree_lib.by_score)


def _logprobs(rng, rows, gamma, vocab):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(rng.normal(size=(rows, gamma, vocab)) * 2.0)))


def _prefixes(tree, row):
  """Each valid node's full prefix (tuple of tokens), following parent links."""
  out = {}
  for i in range(tree.num_nodes):
    if not tree.valid[row, i]:
      continue
    prefix, j = [], i
    while j != tree_lib.NO_PARENT:
      prefix.append(int(tree.tokens[row, j]))
      j = int(tree.parents[row, j])
    out[i] = tuple(reversed(prefix))
  return out


def _brute_force(lp, budget):
  """All prefixes of depth 1..gamma sorted by score: the top `budget`."""
  gamma, vocab = lp.shape
  scored = []
  for d in range(1, gamma + 1):
    for u in itertools.product(range(vocab), repeat=d):
      scored.append((sum(lp[i, t] for i, t in enumerate(u)), u))
  scored.sort(key=lambda x: -x[0])
  return scored[:budget]


@pytest.mark.parametrize("gamma,vocab,budget", [(3, 4, 1), (3, 4, 5), (3, 4, 12), (4, 3, 9),
                                                (2, 5, 30), (4, 6, 16)])
def test_top_b_matches_brute_force_and_is_prefix_closed(gamma, vocab, budget):
  rng = np.random.default_rng(gamma * 100 + vocab * 10 + budget)
  lp = _logprobs(rng, 3, gamma, vocab)
  tree, best_end = jax.device_get(_build(jnp.asarray(lp), budget=budget))
  ordered = jax.device_get(_by_score(tree))
  for row in range(3):
    want = _brute_force(lp[row], budget)
    prefixes = _prefixes(tree, row)
    assert len(prefixes) == len(want)  # fewer than B prefixes exist only if V^1..gamma < B
    assert sorted(prefixes.values()) == sorted(u for _, u in want)
    for i, u in prefixes.items():
      # Score, depth, parents-first, and prefix closure.
      np.testing.assert_allclose(tree.scores[row, i], sum(lp[row, d, t] for d, t in enumerate(u)),
                                 rtol=1e-5, atol=1e-5)
      assert tree.depths[row, i] == len(u)
      parent = tree.parents[row, i]
      if len(u) > 1:
        assert 0 <= parent < i and tree.valid[row, parent] and prefixes[parent] == u[:-1]
      else:
        assert parent == tree_lib.NO_PARENT
    # Siblings carry distinct tokens.
    assert len(set(prefixes.values())) == len(prefixes)
    best = tuple(int(t) for t in lp[row].argmax(-1))
    end = int(best_end[row])
    assert (end != tree_lib.NO_PARENT) == (best in prefixes.values())
    if end != tree_lib.NO_PARENT:
      assert prefixes[end] == best
    # Ordered by score (the cost schedule verifies the first b): same prefixes, scores
    # non-increasing, parents first, so every first b nodes form a tree.
    ranked = _prefixes(ordered, row)
    assert sorted(ranked.values()) == sorted(prefixes.values())
    assert (np.diff(ordered.scores[row][ordered.valid[row]]) <= 0).all()
    assert all(ordered.parents[row, i] < i for i in ranked)
    assert not ordered.valid[row, len(ranked):].any()


def test_padding_when_fewer_prefixes_than_budget():
  lp = _logprobs(np.random.default_rng(0), 1, 2, 2)  # 2 + 4 = 6 prefixes
  tree, _ = jax.device_get(_build(jnp.asarray(lp), budget=8))
  assert tree.valid.sum() == 6 and not tree.valid[0, 6:].any()
  assert (tree.parents[0, 6:] == tree_lib.NO_PARENT).all() and (tree.depths[0, 6:] == 0).all()


@pytest.mark.parametrize("budget", [1, 3, 4, 7])
def test_keep_best_path(budget):
  """The forced best path is in the tree beside the B best others; prefix-closed."""
  gamma, vocab = 3, 5
  rng = np.random.default_rng(budget)
  # Flat distributions: the full-depth best path is outscored by shallow nodes.
  lp = _logprobs(rng, 4, gamma, vocab) * 0.1
  lp = np.asarray(jax.nn.log_softmax(jnp.asarray(lp)))
  keep = np.array([True, False, True, False])
  tree, best_end = jax.device_get(
      _build(jnp.asarray(lp), budget=budget, keep_best_path=jnp.asarray(keep)))
  for row in range(4):
    prefixes = _prefixes(tree, row)
    best = tuple(int(t) for t in lp[row].argmax(-1))
    assert tree.num_nodes == budget + gamma  # the path's own slots
    if keep[row]:
      # The path beside the B best others: a superset of the top B.
      path = {best[:d] for d in range(1, gamma + 1)}
      assert path <= set(prefixes.values())
      assert prefixes[int(best_end[row])] == best
      others = [u for _, u in _brute_force(lp[row], 10 ** 3) if u not in path][:budget]
      assert sorted(prefixes.values()) == sorted(path | set(others))
      assert {u for _, u in _brute_force(lp[row], budget)} <= set(prefixes.values())
    else:
      assert not tree.valid[row, budget:].any()
      assert int(best_end[row]) == tree_lib.NO_PARENT  # flat: deep path loses to shallow ones
      assert sorted(prefixes.values()) == sorted(u for _, u in _brute_force(lp[row], budget))
    for i, u in prefixes.items():
      if len(u) > 1:
        assert prefixes[int(tree.parents[row, i])] == u[:-1]


def _example():
  """root -> a(5) -> b(7); root -> c(6); a -> d(8); and one padding slot."""
  return tree_lib.Tree(
      tokens=jnp.asarray([[5, 6, 7, 8, 0]]), parents=jnp.asarray([[-1, -1, 0, 0, -1]]),
      depths=jnp.asarray([[1, 1, 2, 2, 0]]), scores=jnp.asarray([[-.1, -.2, -.3, -.4, -np.inf]]),
      valid=jnp.asarray([[True, True, True, True, False]]))


def test_ancestor_mask_and_positions():
  mask = np.asarray(_mask(_example(), max_depth=2))[0].astype(int)
  np.testing.assert_array_equal(mask, [
      # root a  c  b  d  pad
      [1, 0, 0, 0, 0, 0],  # root
      [1, 1, 0, 0, 0, 0],  # a
      [1, 0, 1, 0, 0, 0],  # c
      [1, 1, 0, 1, 0, 0],  # b
      [1, 1, 0, 0, 1, 0],  # d
      [1, 0, 0, 0, 0, 1],  # padding: root and itself
  ])
  np.testing.assert_array_equal(tree_lib.positions(_example(), start=jnp.asarray([10])),
                                [[10, 11, 11, 12, 12, 10]])


@pytest.mark.parametrize("chosen,k,tokens", [
    ([5, 8, 0, 0, 0, 0], 2, [5, 8, 0]),  # root -> a -> d, bonus 0 chosen at d
    ([5, 7, 0, 3, 0, 0], 2, [5, 7, 3]),  # -> a -> b, bonus 3 chosen at b
    ([6, 7, 9, 0, 0, 0], 1, [6, 9, 0]),  # -> c, bonus 9 at c
    ([4, 7, 9, 0, 0, 0], 0, [4, 0, 0]),  # no child carries 4: bonus only
    ([0, 7, 9, 0, 0, 0], 0, [0, 0, 0]),  # the padding slot's token 0 never matches
])
def test_walk(chosen, k, tokens):
  tree = _example()
  w = _walk(tree, chosen=jnp.asarray([chosen]), mask=_mask(tree, max_depth=2), max_depth=2)
  assert int(w.num_accepted[0]) == k
  np.testing.assert_array_equal(w.new_tokens[0], tokens)
  want_path = {8: [0, 1, 4], 7: [0, 1, 3], 6: [0, 2, 0]}
  if k:
    np.testing.assert_array_equal(w.path[0], want_path[tokens[k - 1]])


def test_walk_matches_sequential_walk_on_random_trees():
  rng = np.random.default_rng(7)
  gamma, vocab, budget = 4, 3, 10
  lp = _logprobs(rng, 64, gamma, vocab)
  tree = _build(jnp.asarray(lp), budget=budget)[0]
  # Target tokens that often follow the tree: the argmax of perturbed draft scores.
  chosen = rng.integers(0, vocab, size=(64, 1 + budget))
  w = jax.device_get(_walk(tree, chosen=jnp.asarray(chosen), mask=_mask(tree, max_depth=gamma),
                           max_depth=gamma))
  tree = jax.device_get(tree)
  for row in range(64):
    node, path = -1, []
    while True:
      kids = [i for i in range(budget) if tree.valid[row, i] and tree.parents[row, i] == node
              and tree.tokens[row, i] == chosen[row, node + 1]]
      if not kids:
        break
      node = kids[0]
      path.append(node)
    assert int(w.num_accepted[row]) == len(path)
    want = [int(tree.tokens[row, i]) for i in path] + [int(chosen[row, node + 1])]
    assert w.new_tokens[row, :len(path) + 1].tolist() == want
    assert w.path[row, 1:len(path) + 1].tolist() == [i + 1 for i in path]
