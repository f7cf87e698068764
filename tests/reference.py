"""Exact target quantities by direct forwards, for checking the engine against them."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats as scipy_stats

from dloop_jax.decoding.sampling import processed_probs
from dloop_jax.models.transformer import Transformer


def last_logits(target, contexts: list[list[int]]) -> np.ndarray:
  """[N, V] next-token logits after each of N equally long contexts (no cache reuse).

  `target` is our Transformer, or a transformers (PyTorch) causal LM such as
  the reference of `model_fixtures.real_pair`.
  """
  if not isinstance(target, Transformer):
    import model_fixtures  # imports torch: only when a PyTorch model is passed
    return model_fixtures.torch_logits(target, np.asarray(contexts))[:, -1]
  graph, state = nnx.split(target)
  return np.asarray(_jit_last_logits(graph, state, jnp.asarray(contexts, jnp.int32)))


@functools.partial(jax.jit, static_argnums=0)
def _jit_last_logits(graph, state, tokens):
  # One compiled forward per shape: run eagerly, each of its operations would
  # be dispatched (and compiled) on its own.
  target = nnx.merge(graph, state)
  b, t = tokens.shape
  cache = target.init_cache(batch_size=b, capacity=t)
  positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
  return target(tokens, positions=positions, cache=cache).logits[:, -1]


_jit_processed_probs = jax.jit(processed_probs, static_argnums=1)


def exact_distribution(target, prompt: list[int], sampling, depth: int = 3) -> dict[tuple, float]:
  """{(t1, .., t_depth): probability} of the first new tokens, by enumerating the support."""
  dist = {(): 1.0}
  for _ in range(depth):
    seqs = list(dist)
    logits = last_logits(target, [prompt + list(seq) for seq in seqs])
    probs = np.asarray(_jit_processed_probs(jnp.asarray(logits), sampling), np.float64)
    nxt = {}
    for seq, row in zip(seqs, probs):
      for tok in np.nonzero(row > 0)[0]:
        nxt[seq + (int(tok),)] = dist[seq] * row[tok]
    dist = nxt
  return dist


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> tuple[float, float]:
  """Pearson goodness of fit -> (p-value, statistic).

  Outcomes with expected count < 5 are merged into one cell (the usual
  validity condition of the chi-square approximation).
  """
  n = len(samples)
  counts = collections.Counter(samples)
  assert set(counts) <= set(exact), "sampled a sequence outside the target's support"
  expected = np.array([exact[k] * n for k in exact])
  observed = np.array([counts.get(k, 0) for k in exact], np.float64)
  small = expected < 5
  if small.any():
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
  stat = float(((observed - expected) ** 2 / expected).sum())
  return float(scipy_stats.chi2.sf(stat, df=len(expected) - 1)), stat
