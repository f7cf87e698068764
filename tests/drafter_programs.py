"""Jitted drafter programs the checkpoint-format tests compare against references.

Shared by `test_hf_formats.py` (hand-written PyTorch references) and
`test_upstream_parity.py` (the authors' own classes): one batch row, the
context committed from target features, greedy drafting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dloop_jax.decoding import GREEDY


def commit(drafter, features, next_tokens, capacity):
  """The drafter's state after committing n positions: features [n, n_taps, D] and the
  tokens that follow each position [n]."""
  n = features.shape[0]
  state = drafter.init_state(batch_size=1, capacity=capacity)
  return drafter.commit(state, tokens=jnp.zeros((1, n), jnp.int32),
                        features=jnp.asarray(features)[None],
                        next_tokens=jnp.asarray(next_tokens, jnp.int32)[None],
                        starts=jnp.zeros((1,), jnp.int32), counts=jnp.full((1,), n, jnp.int32))


@nnx.jit(static_argnums=(3, 4))
def eagle3_program(drafter, features, next_tokens, num_drafts, capacity):
  """EAGLE-3: logits of every committed pair (training-time test step 0; the last from the
  commit) [n, Vd], and a greedy chain of `num_drafts`: its tokens and log-probabilities."""
  n = features.shape[0]
  tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), next_tokens])[None, :n]
  hid = drafter.ttt_hiddens(tokens=tokens, features=features[None],
                            positions=jnp.arange(n)[None], segment_ids=jnp.ones((1, n), jnp.int32),
                            num_steps=1)[0, 0, :n - 1]
  state = commit(drafter, features, next_tokens, capacity)
  logits = jnp.concatenate([drafter.draft_logits(hid), drafter.draft_logits(state.hidden)])
  _, stage = drafter.draft_stage(state, key=jax.random.key(0), block_size=num_drafts,
                                 sampling=GREEDY)
  return logits, stage.tokens[0], stage.logprobs[0]
