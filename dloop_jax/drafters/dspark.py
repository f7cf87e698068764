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
final-norm hidden state the LM head reads (DeepSpec's
`confidence_head_with_markov`; without it, or without a Markov head,
c_k = sigmoid(w . z_k + b)): the drafter's estimate of the
probability that draft k is accepted given the drafts before it are. It is
trained toward 1 - 1/2 ||p_draft - p_target||_1 (that acceptance probability
under the sampling rule) and returned as `DraftStage.confidence`: the
verification scheduler's c_k by default (`generate(confidence="auto")`). It
reads the state before draft k is drawn and the token before k, never draft k,
as the sampling scheduler's causal admission requires (`decoding.schedule`).

Draft vocabulary. A trained drafter restricted to its commonest ids
(`with_draft_vocab`) keeps every weight: W2's rows are the logits' rows, so it
reads the draft ids' rows of W2 (gathered once per generation into
`DSparkState.markov_rows`), as the backbone does the target's head rows, and
its logits are the full drafter's at those ids. W1 stays indexed by the
previous token, a target id: drafts are mapped back before they are fed.

Weights use the names and layouts of DeepSpec's checkpoints where there is one
(`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
`confidence_head.proj.weight` [1, H + r], `confidence_head.proj.bias` [1]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters import layers
from dloop_jax.decoding.drafter import DraftStage
from dloop_jax.drafters.block import BlockDrafter, BlockState
from dloop_jax.drafters.spec import DrafterSpec
from dloop_jax.models.transformer import Transformer, rms_norm


@struct.dataclass
class DSparkState(BlockState):
  """Block drafter state plus the Markov head's output rows of a draft vocabulary.

  Attributes:
    markov_rows: [Vd, r] the draft ids' rows of `markov_w2`, gathered once per
      generation (as `head_rows`); None over the full vocabulary or without a
      Markov head (the parameter is then read as is).
  """

  markov_rows: jax.Array | None = None


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
      self.confidence_proj = nnx.Param(jnp.zeros((1, d + self.confidence_rank), dtype))
      self.confidence_bias = nnx.Param(jnp.zeros((1,), dtype))
    else:
      self.confidence_proj = self.confidence_bias = None

  @property
  def has_confidence(self) -> bool:
    return self.confidence_proj is not None

  @property
  def confidence_rank(self) -> int:
    """Width of the Markov embedding the confidence head reads (0: the hidden state alone)."""
    return self.spec.markov_rank if self.spec.confidence_head_with_markov else 0

  # ------------------------------------------------------------------ heads
  def markov_bias(self, prev: jax.Array, *, rows: jax.Array | None = None) -> jax.Array:
    """Previous tokens [...] (target ids) -> f32 logit bias [..., Vd] (0 without a Markov head).

    `rows` is `DSparkState.markov_rows` when the caller has it.
    """
    if self.markov_w1 is None:
      vd = self.spec.draft_vocab_size if self.reduced_vocab else self.vocab_size
      return jnp.zeros(prev.shape + (vd,), jnp.float32)
    if rows is None:
      rows = self.draft_vocab_rows(self.markov_w2[...])
    e = jnp.take(self.markov_w1[...], prev, axis=0)
    return (e @ rows.T).astype(jnp.float32)

  def head_logits(self, hidden: jax.Array, prev: jax.Array, *,
                  head_rows: jax.Array | None = None,
                  markov_rows: jax.Array | None = None) -> jax.Array:
    """Backbone outputs [..., D] and previous tokens [...] -> f32 draft logits [..., Vd]."""
    return (self.draft_logits(hidden, head_rows=head_rows)
            + self.markov_bias(prev, rows=markov_rows))

  def confidence_logit(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
    """Backbone outputs [..., D], previous tokens [...] -> f32 logit of c_k [...]."""
    if self.confidence_proj is None:
      raise ValueError("This DSpark drafter has no confidence head"
                       " (enable_confidence_head=False).")
    z = rms_norm(hidden, self.final_norm[...], self.eps)
    if self.confidence_rank:
      z = jnp.concatenate([z, jnp.take(self.markov_w1[...], prev, axis=0).astype(z.dtype)], -1)
    w = self.confidence_proj[...][0]
    return (z @ w + self.confidence_bias[...][0]).astype(jnp.float32)

  # -------------------------------------------------------------- interface
  def init_state(self, *, batch_size: int, capacity: int) -> DSparkState:
    base = super().init_state(batch_size=batch_size, capacity=capacity)
    w2 = None if self.markov_w2 is None else self.markov_w2[...]
    return base.extended(DSparkState, markov_rows=self.held_draft_vocab_rows(w2))

  def draft_stage(self, state, *, key, block_size, sampling):
    state, h = self.backbone_stage(state, block_size)  # h [B, gamma, D]
    base = self.draft_logits(h, head_rows=state.head_rows)  # [B, gamma, Vd]

    def step(prev, xs):
      # Only the Markov bias is sequential: draft k's distribution depends on
      # draft k-1, so a sampled draft is drawn from (and verified against)
      # exactly the distribution its predecessors imply.
      base_k, h_k, key_k = xs
      logits = base_k + self.markov_bias(prev, rows=state.markov_rows)
      draft_id = sampling_lib.next_token(key_k, logits, sampling)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), draft_id[:, None],
                                    axis=-1)[:, 0]
      probs = None if sampling.greedy else sampling_lib.processed_probs(logits, sampling)
      conf = (None if self.confidence_proj is None
              else jax.nn.sigmoid(self.confidence_logit(h_k, prev)))
      # The heads read the previous token as a target id (W1's rows).
      token = self.to_target_ids(draft_id).astype(jnp.int32)
      return token, (token, logprob, probs, conf)

    keys = jax.random.split(key, block_size)
    _, (tokens, logprobs, probs, conf) = jax.lax.scan(
        step, state.anchor, (jnp.swapaxes(base, 0, 1), jnp.swapaxes(h, 0, 1), keys))
    t = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    tokens = t(tokens)
    probs = None if probs is None else self.to_target_probs(t(probs))
    state = state.replace(anchor=tokens[:, -1])
    return state, DraftStage(tokens=tokens, logprobs=t(logprobs), probs=probs,
                             confidence=t(conf))
