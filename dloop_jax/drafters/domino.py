"""Domino drafter: a block backbone plus a causal GRU correction head.

Backbone. The block drafter's layers with the anchor as the first prediction
position (`BlockDrafter.shifted`, as in DSpark): a stage over x_n (the anchor)
and gamma - 1 masks gives outputs 0 .. gamma - 1, output i predicting
x_{n+i+1}; z_i (final-norm hidden state) through the target's LM head gives
the base logits.

Head. A one-layer GRU without bias (PyTorch gate order r, z, n) reads the
target's input embeddings of the tokens realised in the block, anchor first,
from a zero state:

    s_0 = GRU(0, e(x_n)),   s_i = GRU(s_{i-1}, e(d_i))     (d_i: draft i)

and a low-rank MLP corrects the base logits of every position but the first
(the anchor's own output, a pure backbone draft):

    logits_0 = base_0
    logits_i = base_i + W2 silu(W1 [z_i ; s_i])      i >= 1

so draft i + 1 depends on the drafts before it. At inference a GRU step
projects the one token it reads, e(x) W_ih^T ([D] x [D, 3G]), and multiplies
its state by W_hh (G x 3G). A table of every vocabulary entry's projection
([V, 3G]) would save those products at the price of computing all V of them:
for SmolLM2 (V = 49,152, D = 576, 3G = 768) 21.7 GFLOP per generation, more
than the head's products over a whole answer (a few hundred tokens). DLoop's gate scores the corrected log-probabilities.

The GRU state lives only inside a stage: every stage (every block) starts from
a zero state over its own anchor, as in training, so nothing of the head is
carried across stages or committed; the context of later stages is the
backbone's stand-ins, as for the block drafter.

Draft vocabulary. A trained drafter restricted to its commonest ids
(`with_draft_vocab`) keeps every weight: W2's rows are the logits' rows, so it
reads the draft ids' rows of W2 (gathered once per generation into
`DominoState.correction_rows`), as the backbone does the target's head rows,
and its logits are the full drafter's at those ids. The GRU reads the target's
embeddings: drafts are mapped back to target ids before they are fed, and
DARTree's candidates are target ids.

Weights use the layouts of Domino's checkpoints: `gru_w_ih` [3G, H]
(`prefix_gru.weight_ih_l0`), `gru_w_hh` [3G, G] (`weight_hh_l0`),
`correction_w1` [r, H + G] (`embed_proj.0.weight`), `correction_w2` [V, r]
(`embed_proj.2.weight`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters import layers
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.decoding.drafter import DraftStage, TreeStage
from dloop_jax.drafters.block import BlockDrafter, BlockState
from dloop_jax.drafters.spec import DrafterSpec
from dloop_jax.models.transformer import Transformer, rms_norm, take_rows


@struct.dataclass
class DominoState(BlockState):
  """Block drafter state plus the correction head's rows of a draft vocabulary.

  Attributes:
    correction_rows: [Vd, r] the draft ids' rows of `correction_w2`, gathered
      once per generation (as `head_rows`); None over the full vocabulary (the
      parameter is then read as is).
  """

  correction_rows: jax.Array | None = None


def gru_step(h: jax.Array, gi: jax.Array, w_hh: jax.Array) -> jax.Array:
  """One bias-free GRU step (PyTorch gate order r, z, n).

  Args:
    h: [..., G] previous state.
    gi: [..., 3G] input projection x @ W_ih^T.
    w_hh: [3G, G] recurrent weights.

  Returns:
    [..., G] the next state.
  """
  gh = h @ w_hh.T
  i_r, i_z, i_n = jnp.split(gi, 3, axis=-1)
  h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)
  r = jax.nn.sigmoid(i_r + h_r)
  z = jax.nn.sigmoid(i_z + h_z)
  n = jnp.tanh(i_n + r * h_n)
  return (1.0 - z) * n + z * h


class DominoDrafter(BlockDrafter):
  """Shifted block backbone + GRU-over-the-prefix low-rank logit correction."""

  shifted = True
  # DARTree: trees grown depth by depth from the corrected logits (`draft_tree_stage`).
  supports_trees = True
  # Prefixes kept per depth before the global top-B prune (DARTree's default width).
  tree_width = 12

  def __init__(self, spec: DrafterSpec, *, target: Transformer, rngs: nnx.Rngs):
    super().__init__(spec, target=target, rngs=rngs)
    self.name = "domino"
    v, d, dtype = self.vocab_size, target.config.hidden_size, target.dtype
    g, r = spec.gru_hidden_size, spec.correction_rank
    # PyTorch's GRU init scale (uniform +-1/sqrt(G)), as a normal of that std.
    self.gru_w_ih = nnx.Param(layers.init_weight(rngs, (3 * g, d), fan_in=g, dtype=dtype))
    self.gru_w_hh = nnx.Param(layers.init_weight(rngs, (3 * g, g), fan_in=g, dtype=dtype))
    self.correction_w1 = nnx.Param(layers.init_weight(rngs, (r, d + g), fan_in=d + g,
                                                      dtype=dtype))
    # Zero: an untrained head leaves the backbone's logits unchanged.
    self.correction_w2 = nnx.Param(jnp.zeros((v, r), dtype))

  # ------------------------------------------------------------------- head
  def gru_inputs(self, tokens: jax.Array) -> jax.Array:
    """Tokens [...] (target ids) -> GRU input projections e(x) W_ih^T [..., 3G]."""
    e = take_rows(self.embed[...], tokens).astype(self.gru_w_ih[...].dtype)
    return e @ self.gru_w_ih[...].T

  def prefix_states(self, gi: jax.Array) -> jax.Array:
    """Input projections [..., Q, 3G] of x_0 .. x_{Q-1} -> states s_0 .. s_{Q-1} [..., Q, G]."""
    w_hh = self.gru_w_hh[...]
    h0 = jnp.zeros(gi.shape[:-2] + (w_hh.shape[1],), gi.dtype)

    def step(h, g):
      h = gru_step(h, g, w_hh)
      return h, h

    _, hs = jax.lax.scan(step, h0, jnp.moveaxis(gi, -2, 0))
    return jnp.moveaxis(hs, 0, -2)

  def correction(self, hidden: jax.Array, states: jax.Array, *,
                 rows: jax.Array | None = None) -> jax.Array:
    """Backbone outputs [..., D], GRU states [..., G] -> f32 logit corrections [..., Vd].

    `rows` is `DominoState.correction_rows` when the caller has it.
    """
    if rows is None:
      rows = self.draft_vocab_rows(self.correction_w2[...])
    z = rms_norm(hidden, self.final_norm[...], self.eps)
    x = jnp.concatenate([z, states.astype(z.dtype)], axis=-1)
    return (jax.nn.silu(x @ self.correction_w1[...].T) @ rows.T).astype(jnp.float32)

  def corrected_logits(self, hidden: jax.Array, tokens: jax.Array, *,
                       head_rows: jax.Array | None = None,
                       correction_rows: jax.Array | None = None) -> jax.Array:
    """Teacher-forced logits of a block.

    Args:
      hidden: [..., gamma, D] backbone outputs (output i predicts x_{i+1}).
      tokens: [..., gamma] the block's realised tokens x_0 (anchor) .. x_{gamma-1}
        (target ids).
      head_rows: `_head_rows()` when the caller has it.
      correction_rows: `DominoState.correction_rows` when the caller has it.

    Returns:
      (base, corrected) f32 logits [..., gamma, Vd].
    """
    base = self.draft_logits(hidden, head_rows=head_rows)
    corr = self.correction(hidden, self.prefix_states(self.gru_inputs(tokens)),
                           rows=correction_rows)
    first = (jnp.arange(hidden.shape[-2]) == 0)[:, None]
    return base, base + jnp.where(first, 0.0, corr)

  # -------------------------------------------------------------- interface
  def init_state(self, *, batch_size: int, capacity: int) -> DominoState:
    base = super().init_state(batch_size=batch_size, capacity=capacity)
    return base.extended(DominoState,
                         correction_rows=self.held_draft_vocab_rows(self.correction_w2[...]))

  def draft_stage(self, state, *, key, block_size, sampling):
    state, h = self.backbone_stage(state, block_size)  # h [B, gamma, D]
    base = self.draft_logits(h, head_rows=state.head_rows)  # [B, gamma, Vd]
    w_hh, rows = self.gru_w_hh[...], state.correction_rows
    s0 = gru_step(jnp.zeros((h.shape[0], w_hh.shape[1]), w_hh.dtype),
                  self.gru_inputs(state.anchor), w_hh)

    def step(s, xs):
      # s = GRU state after the tokens realised so far in this block.
      i, base_i, h_i, key_i = xs
      logits = base_i + jnp.where(i == 0, 0.0, self.correction(h_i, s, rows=rows))
      draft_id = sampling_lib.next_token(key_i, logits, sampling)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), draft_id[:, None],
                                    axis=-1)[:, 0]
      probs = None if sampling.greedy else sampling_lib.processed_probs(logits, sampling)
      # The GRU reads target ids (the embedding's rows).
      token = self.to_target_ids(draft_id).astype(jnp.int32)
      s = gru_step(s, self.gru_inputs(token), w_hh)
      return s, (token, logprob, probs)

    xs = (jnp.arange(block_size), jnp.swapaxes(base, 0, 1), jnp.swapaxes(h, 0, 1),
          jax.random.split(key, block_size))
    _, (tokens, logprobs, probs) = jax.lax.scan(step, s0, xs)
    t = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
    tokens = t(tokens)
    probs = None if probs is None else self.to_target_probs(t(probs))
    state = state.replace(anchor=tokens[:, -1])
    return state, DraftStage(tokens=tokens, logprobs=t(logprobs), probs=probs)

  def draft_tree_stage(self, state, *, block_size, budget):
    """DARTree: a stage's tree grown depth by depth from the corrected logits.

    Every kept prefix carries its own GRU state. Depth 1 reads the anchor's
    output (base logits, no correction); at depth d each of the W prefixes of
    depth d - 1 (W = `tree_width`) corrects the base logits of output d - 1
    with its own state, its K = min(W, Vd) best children are scored (parent
    score + child log-probability), the W best of those W * K candidates are
    kept and their states advanced in one batched GRU step. The drafter's
    chain (the argmax child of the chain's node, from the anchor) is always
    kept, in slot 0: it is the stage's best path, whose distributions the
    gate scores and from whose end a following stage drafts. `tree.select`
    then keeps the global top B (`budget`). Candidate tokens are target ids
    (the GRU reads them), whatever the draft vocabulary.

    Returns:
      The state after the chain (as after a greedy `draft_stage`) and a
      `TreeStage` with the scored prefixes (`candidates` [B, gamma, W]).
    """
    state, h = self.backbone_stage(state, block_size)  # h [B, gamma, D]
    base = self.draft_logits(h, head_rows=state.head_rows)  # [B, gamma, Vd]
    w_hh, corr_rows = self.gru_w_hh[...], state.correction_rows
    b, v = base.shape[0], base.shape[-1]
    w = self.tree_width
    k = min(w, v)
    neg_inf = jnp.float32(-jnp.inf)
    rows = jnp.arange(b)[:, None]

    # Depth 1: the anchor's output, uncorrected; every slot's state is then
    # GRU(GRU(0, e(anchor)), e(its token)).
    lp = jax.nn.log_softmax(base[:, 0].astype(jnp.float32))  # [B, Vd]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    top_ids = self.to_target_ids(top_ids)
    score = jnp.pad(top_lp, ((0, 0), (0, w - k)), constant_values=neg_inf)  # [B, W]
    token = jnp.pad(top_ids, ((0, 0), (0, w - k))).astype(jnp.int32)
    s0 = gru_step(jnp.zeros((b, w_hh.shape[1]), w_hh.dtype), self.gru_inputs(state.anchor),
                  w_hh)
    states = gru_step(jnp.broadcast_to(s0[:, None], (b, w, s0.shape[-1])),
                      self.gru_inputs(token), w_hh)  # [B, W, G]
    scores, tokens = [score], [token]
    parents = [jnp.full((b, w), tree_lib.NO_PARENT, jnp.int32)]
    for d in range(1, block_size):
      logits = base[:, d, None] + self.correction(
          jnp.broadcast_to(h[:, d, None], (b, w, h.shape[-1])), states,
          rows=corr_rows)  # [B, W, Vd]
      lp = jax.nn.log_softmax(logits)
      top_lp, top_ids = jax.lax.top_k(lp, k)  # [B, W, K]
      top_ids = self.to_target_ids(top_ids)
      cand = (score[:, :, None] + top_lp).reshape(b, w * k)
      # Candidate 0 (slot 0's argmax child) continues the chain: kept in slot 0.
      _, pick = jax.lax.top_k(cand.at[:, 0].set(jnp.inf), w)
      score = jnp.take_along_axis(cand, pick, axis=1)
      parent = (pick // k).astype(jnp.int32)
      token = jnp.take_along_axis(top_ids.reshape(b, w * k), pick, axis=1).astype(jnp.int32)
      states = gru_step(states[rows, parent], self.gru_inputs(token), w_hh)
      scores.append(score)
      tokens.append(token)
      parents.append(parent)
    stack = lambda xs: jnp.stack(xs, axis=1)  # [B, gamma, W]
    cands = tree_lib.Candidates(scores=stack(scores), tokens=stack(tokens), parents=stack(parents),
                                best=jnp.broadcast_to(jnp.arange(w) == 0, (b, block_size, w)))
    state = state.replace(anchor=tokens[-1][:, 0])
    return state, TreeStage(candidates=cands)
