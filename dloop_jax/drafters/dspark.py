"""DSpark drafter: a block backbone, a Markov head and a confidence head.

Backbone. The block drafter's layers with the anchor as the first prediction
position (`BlockDrafter.shifted`): after committing x_0 .. x_n a stage feeds

    position   n        n+1    ..  n+gamma-1
    input      x_n      [M]    ..  [M]
    output     d_1      d_2    ..  d_gamma         (base logits U_k)

so one forward gives all gamma drafts. Later DLoop stages read the drafter's
own hidden states as context, exactly as the block drafter's do.

Markov head (rank r). The backbone's drafts are independent given the
context; the head makes draft k depend on the token just before it:

    logits_k = U_k + W2 W1[x_{k-1}]          W1: [V, r] embedding, W2: [V, r]

with x_0 the anchor and x_{k-1} the draft before. Inside a stage only this
rank-r bias runs left to right (a gather of r values and a V x r product per
draft); the backbone still runs once per stage.

Confidence head. c_k = sigmoid(w . [z_k ; W1[x_{k-1}]] + b), with z_k the
final-norm hidden state the LM head reads: the drafter's estimate of the
probability that draft k is accepted given the drafts before it are. It is
trained toward 1 - 1/2 ||p_draft - p_target||_1 (that acceptance probability
under the sampling rule) and returned as `DraftStage.confidence`: the
verification scheduler's c_k by default (`generate(confidence="auto")`). It
reads the state before draft k is drawn and the token before k, never draft k,
as the sampling scheduler's causal admission requires (`decoding.schedule`).

Weights use the names and layouts of DeepSpec's checkpoints where there is one
(`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
`confidence_head.proj.weight` [1, H + r], `confidence_head.proj.bias` [1]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters import layers
from dloop_jax.drafters.base import DraftStage
from dloop_jax.drafters.block import BlockDrafter
from dloop_jax.drafters.spec import DrafterSpec
from dloop_jax.models.transformer import Transformer, rms_norm


class DSparkDrafter(BlockDrafter):
  """Shifted block backbone + rank-r Markov head + confidence head."""

  shifted = True
  # Trees from the backbone's logits alone would leave out the Markov head (a DARTree-style
  # tree for this head, as Domino's, is not built yet).
  supports_trees = False

  def __init__(self, spec: DrafterSpec, *, target: Transformer, rngs: nnx.Rngs):
    super().__init__(spec, target=target, rngs=rngs)
    self.name = "dspark"
    v, d, r = self.vocab_size, target.config.hidden_size, spec.markov_rank
    dtype = target.dtype
    if r:
      self.markov_w1 = nnx.Param(layers.init_weight(rngs, (v, r), fan_in=r, dtype=dtype))
      # Zero: an untrained head leaves the backbone's logits unchanged.
      self.markov_w2 = nnx.Param(jnp.zeros((v, r), dtype))
    else:
      self.markov_w1 = self.markov_w2 = None
    if spec.enable_confidence_head:
      self.confidence_proj = nnx.Param(jnp.zeros((1, d + r), dtype))
      self.confidence_bias = nnx.Param(jnp.zeros((1,), dtype))
    else:
      self.confidence_proj = self.confidence_bias = None

  @property
  def has_confidence(self) -> bool:
    return self.confidence_proj is not None

  # ------------------------------------------------------------------ heads
  def markov_bias(self, prev: jax.Array) -> jax.Array:
    """Previous tokens [...] -> f32 logit bias [..., V] (0 without a Markov head)."""
    if self.markov_w1 is None:
      return jnp.zeros(prev.shape + (self.vocab_size,), jnp.float32)
    e = jnp.take(self.markov_w1[...], prev, axis=0)
    return (e @ self.markov_w2[...].T).astype(jnp.float32)

  def head_logits(self, hidden: jax.Array, prev: jax.Array, *,
                  head_rows: jax.Array | None = None) -> jax.Array:
    """Backbone outputs [..., D] and previous tokens [...] -> f32 draft logits [..., V]."""
    return self.draft_logits(hidden, head_rows=head_rows) + self.markov_bias(prev)

  def confidence_logit(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
    """Backbone outputs [..., D], previous tokens [...] -> f32 logit of c_k [...]."""
    if self.confidence_proj is None:
      raise ValueError("This DSpark drafter has no confidence head"
                       " (enable_confidence_head=False).")
    z = rms_norm(hidden, self.final_norm[...], self.eps)
    if self.markov_w1 is not None:
      z = jnp.concatenate([z, jnp.take(self.markov_w1[...], prev, axis=0).astype(z.dtype)], -1)
    w = self.confidence_proj[...][0]
    return (z @ w + self.confidence_bias[...][0]).astype(jnp.float32)

  # -------------------------------------------------------------- interface
  def draft_stage(self, state, *, key, block_size, sampling):
    state, h = self.backbone_stage(state, block_size)  # h [B, gamma, D]
    base = self.draft_logits(h, head_rows=state.head_rows)  # [B, gamma, V]

    def step(prev, xs):
      # Only the Markov bias is sequential: draft k's distribution depends on
      # draft k-1, so a sampled draft is drawn from (and verified against)
      # exactly the distribution its predecessors imply.
      base_k, h_k, key_k = xs
      logits = base_k + self.markov_bias(prev)
      token = sampling_lib.next_token(key_k, logits, sampling).astype(jnp.int32)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
      probs = None if sampling.greedy else sampling_lib.processed_probs(logits, sampling)
      conf = (None if self.confidence_proj is None
              else jax.nn.sigmoid(self.confidence_logit(h_k, prev)))
      return token, (token, logprob, probs, conf)

    keys = jax.random.split(key, block_size)
    _, (tokens, logprobs, probs, conf) = jax.lax.scan(
        step, state.anchor, (jnp.swapaxes(base, 0, 1), jnp.swapaxes(h, 0, 1), keys))
    t = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    tokens = t(tokens)
    state = state.replace(anchor=tokens[:, -1])
    return state, DraftStage(tokens=tokens, logprobs=t(logprobs), probs=t(probs),
                             confidence=t(conf))
