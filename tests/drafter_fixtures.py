"""Test drafters built from the target itself (fixtures, not product drafters).

  oracle     drafts with the target: every greedy draft is accepted.
  perturbed  target logits plus a fixed context-dependent perturbation:
             partial acceptance.
  random     a fixed random table indexed by the last token, no target:
             near-zero acceptance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding.drafter import Drafter, DraftStage, TreeStage
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models.transformer import Transformer


@struct.dataclass
class TargetDrafterState:
  cache: kv_lib.KVCache
  pending: jax.Array  # [B] next token to read


class TargetDrafter(Drafter):
  """Autoregressive drafter: w * target logits + scale * table[last token]."""

  def __init__(self, target: Transformer, *, target_weight: float, noise_scale: float,
               seed: int = 0, block_size: int = 3):
    config = target.config
    self.model = Transformer.from_params(config, target.flat_params())
    table = jax.random.normal(jax.random.key(seed), (config.vocab_size, config.vocab_size))
    self.noise = nnx.Param(table * noise_scale)
    # Arrays, not Python floats: all fixtures share one graph, so one compile.
    self.target_weight = nnx.Param(jnp.asarray(target_weight, jnp.float32))
    self.kind = "autoregressive"
    self.taps = (0,)
    self.block_size = block_size
    self.target_fingerprint = tuple(sorted(config.fingerprint.items()))
    self.name = "target-fixture"

  def init_state(self, *, batch_size, capacity):
    return TargetDrafterState(cache=self.model.init_cache(batch_size=batch_size, capacity=capacity),
                              pending=jnp.zeros((batch_size,), jnp.int32))

  def commit(self, state, *, tokens, features, next_tokens, starts, counts):
    del features
    w = tokens.shape[1]
    cache = state.cache.with_lengths(starts)
    positions = starts[:, None] + jnp.arange(w)[None, :]
    cache = self.model(tokens, positions=positions, cache=cache).cache
    last = jnp.take_along_axis(next_tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    return TargetDrafterState(cache=cache.with_lengths(starts + counts),
                              pending=jnp.where(counts > 0, last, state.pending))

  def _logits(self, cache, pending):
    out = self.model(pending[:, None], positions=cache.lengths[:, None], cache=cache)
    logits = self.target_weight[...] * out.logits[:, 0] + self.noise[...][pending]
    return logits, out.cache

  def draft_stage(self, state, *, key, block_size, sampling):
    def step(carry, step_key):
      cache, pending = carry
      logits, cache = self._logits(cache, pending)
      token = sampling_lib.next_token(step_key, logits, sampling)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=1)[:, 0]
      probs = None if sampling.greedy else sampling_lib.processed_probs(logits, sampling)
      return (cache, token), (token, logprob, probs)

    (cache, pending), (tokens, logprobs, probs) = jax.lax.scan(
        step, (state.cache, state.pending), jax.random.split(key, block_size))
    stage = DraftStage(tokens=tokens.T, logprobs=logprobs.T,
                       probs=None if probs is None else jnp.swapaxes(probs, 0, 1))
    return TargetDrafterState(cache=cache, pending=pending), stage


  supports_trees = True

  def draft_tree_stage(self, state, *, block_size, budget):
    """The greedy chain's distribution at each step stands in for the marginals."""
    del budget
    def step(carry, _):
      cache, pending = carry
      logits, cache = self._logits(cache, pending)
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return (cache, token), jax.nn.log_softmax(logits.astype(jnp.float32))

    (cache, pending), logprobs = jax.lax.scan(step, (state.cache, state.pending), None,
                                              length=block_size)
    return (TargetDrafterState(cache=cache, pending=pending),
            TreeStage(logprobs=jnp.swapaxes(logprobs, 0, 1)))


def oracle(target, **kw):
  return TargetDrafter(target, target_weight=1.0, noise_scale=0.0, **kw)


def perturbed(target, *, noise_scale=0.3, **kw):
  return TargetDrafter(target, target_weight=1.0, noise_scale=noise_scale, **kw)


def random_drafter(target, **kw):
  return TargetDrafter(target, target_weight=0.0, noise_scale=3.0, **kw)
