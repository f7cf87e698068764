"""DFlash-style block drafter (parallel): one forward drafts a whole block.

Context. For every committed position j the target's tapped hidden states are
fused into one context vector

    c_j = RMSNorm(fc(concat of the taps at j))                          [D]

and every drafter layer l turns it into an extra key/value pair
(k_l(c_j) with RoPE at j, v_l(c_j)): the context is never a query, so its
keys/values are computed once, at commit, and cached in the drafter state.

Query block. After committing x_0 .. x_n (x_n = the pending token, which the
target has not read, so it has no context vector), a stage feeds

    position   n        n+1    ..  n+gamma
    input      x_n      [M]    ..  [M]          ([M]: the mask input, below)
    output     -        d_1    ..  d_gamma      (final norm + the target's LM head)

through N decoder layers. The block attends to itself bidirectionally and to the
context of positions < n: the anchor x_n sits at position n, right after the
last context position, as in DFlash (`dflash_generate`: the block starts at
`start`, the context covers `[.., start)`). With n = 3 and gamma = 2:

    key:          c_0 c_1 c_2 | x_3 M_4 M_5
    query x_3     x   x   x   | x   x   x
    query M_4     x   x   x   | x   x   x
    query M_5     x   x   x   | x   x   x

DLoop stages. The next stage's anchor is this stage's last draft d_gamma at
position n + gamma, and it needs context at the unverified positions
n .. n + gamma - 1, where there are no target features. There the drafter's own
hidden states stand in, aligned by what they predict: the target feature at j
predicts x_{j+1}, and so does the block output at position j + 1, so

    c_j (stand-in) = RMSNorm(h_{j+1}),   j = n .. n + gamma - 1

with h the last layer's output (before the final norm) and the same RMSNorm
(weights) as the target context: as in EAGLE-3, the drafter's own state
replaces fc's output directly, and no parameter is added. Loop-aware training
(`dloop_jax.training.objectives`) teaches the layers to read these. Verification
then overwrites the stand-ins of accepted positions with target context
(`commit` rolls back to `starts`).

The token embedding and the LM head are the target's (frozen). With a
`draft_vocab_size` the head is restricted to the draft vocabulary's columns.
The mask input [M] is a learned vector `mask_embed`, or, with a
`mask_token_id` (DFlash's convention), the target's embedding of that token:
then the drafter has no mask parameter and writes to the DFlash layout as is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.drafters import layers
from dloop_jax.drafters import vocab as vocab_lib
from dloop_jax.decoding.drafter import Drafter, DraftStage, TreeStage
from dloop_jax.drafters.base import Frozen, VocabMap
from dloop_jax.drafters.spec import DrafterSpec
from dloop_jax.errors import ConfigError
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import rope as rope_lib
from dloop_jax.models.transformer import (Transformer, dense, dense_out_major, is_half,
                                          project_rows, rms_norm, take_rows)


@struct.dataclass
class BlockState:
  """Block drafter decoding state.

  Attributes:
    k: [L, B, C, K, H] context keys of every drafter layer (RoPE applied).
    v: [L, B, C, K, H] context values.
    lengths: [B] context positions held (target context, then stand-ins).
    anchor: [B] token at position `lengths`: the next block's first input.
    committed_anchor: [B] `anchor` after the last commit (restored for rows a
      commit leaves unchanged).
    head_rows: [Vd, D] LM-head rows of the draft vocabulary, gathered once per
      generation instead of once per stage (8,192 x 576 rows of SmolLM2 take
      as long to gather as a third of the stage), in `DRAFT_HEAD_DTYPE`.
    layers: per layer, its weights sliced out of the stacked parameters once
      per generation (`BlockDrafter.drafting_layers`).
    kv_rows: [L, 2 KV, D] the key and value columns of every layer's `wqkv`,
      transposed once per generation (`BlockDrafter.context_kv_rows`).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  anchor: jax.Array
  committed_anchor: jax.Array
  head_rows: jax.Array
  layers: tuple[dict[str, jax.Array], ...]
  kv_rows: jax.Array

  def extended(self, cls: type, **extra) -> "BlockState":
    """This state as `cls` (a subclass: a head drafter's state) with its `extra` fields."""
    return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **extra)


# Drafting reads the head rows in bf16 (products accumulate in f32). The head is
# the largest product of a drafting stage, and a few rows times a matrix cost
# the bytes streamed, which bf16 halves (docs/design.md §Choices for XLA:CPU).
# Drafts are proposals the target checks, so no output changes;
# the draft logits move by the bf16 rounding of the head and its input.
DRAFT_HEAD_DTYPE = jnp.bfloat16
# The same for the layers' matrices while drafting (converted once per
# generation; a drafter's `draft_layer_dtype`): a stage's few rows times 16-bit
# matrices stream half the bytes. In 16 bits they are also held out-major, as
# the target's layers are (`transformer.LAYER_MATRICES`).
DRAFT_LAYER_DTYPE = jnp.bfloat16
_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [..., heads, H] by angles [..., H] (any leading dims, broadcast)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[..., None, :].astype(x.dtype) + rotated * sin[..., None, :].astype(x.dtype)


class BlockDrafter(Drafter):
  """N decoder layers drafting [anchor, mask x gamma] against cached target context."""

  # The block convention. False (z-lab DFlash): the block is [anchor, M x gamma]
  # and output j predicts its own position, so the anchor's output is no draft.
  # True (DSpark, Domino): the block is [anchor, M x (gamma - 1)] and output j
  # predicts position j + 1, so all gamma outputs are drafts. Either way the
  # last gamma outputs are the drafts, and the one predicting x_{j+1} sits at
  # position j, which is where its stand-in context goes.
  shifted = False

  def __init__(self, spec: DrafterSpec, *, target: Transformer, rngs: nnx.Rngs):
    c = target.config
    d, dtype, nl = c.hidden_size, target.dtype, spec.num_layers
    self.spec = spec
    self.kind = "parallel"
    self.taps = tuple(spec.taps)
    self.block_size = spec.block_size
    self.target_fingerprint = tuple(sorted(c.fingerprint.items()))
    self.name = "block"
    self.vocab_size = c.vocab_size
    self.eps = c.rms_norm_eps
    self.target_config = c
    self.reduced_vocab = 0 < spec.draft_vocab_size < c.vocab_size
    # Storage of the layer matrices while drafting (`drafting_layers`); None:
    # the parameters' own dtype.
    self.draft_layer_dtype = DRAFT_LAYER_DTYPE

    n_taps = len(spec.taps)
    self.fc = nnx.Param(layers.init_weight(rngs, (n_taps * d, d), fan_in=n_taps * d, dtype=dtype))
    self.ctx_norm = nnx.Param(jnp.ones((d,), dtype))
    # A learned mask vector, or (mask_token_id) a row of the frozen embedding.
    self.mask_embed = (None if spec.mask_token_id is not None else
                       nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (d,), dtype)))
    self.attn_norm = nnx.Param(jnp.ones((nl, d), dtype))
    self.wqkv = nnx.Param(layers.init_weight(
        rngs, (nl, d, spec.q_size + 2 * spec.kv_size), fan_in=d, dtype=dtype))
    self.q_norm = nnx.Param(jnp.ones((nl, spec.head_dim), dtype)) if spec.qk_norm else None
    self.k_norm = nnx.Param(jnp.ones((nl, spec.head_dim), dtype)) if spec.qk_norm else None
    self.wo = nnx.Param(layers.init_weight(rngs, (nl, spec.q_size, d), fan_in=spec.q_size,
                                           dtype=dtype, scale=0.5))
    self.mlp_norm = nnx.Param(jnp.ones((nl, d), dtype))
    self.w_gate_up = nnx.Param(layers.init_weight(
        rngs, (nl, d, 2 * spec.intermediate_size), fan_in=d, dtype=dtype))
    self.w_down = nnx.Param(layers.init_weight(
        rngs, (nl, spec.intermediate_size, d), fan_in=spec.intermediate_size, dtype=dtype,
        scale=0.5))
    self.final_norm = nnx.Param(jnp.asarray(target.final_norm[...], dtype))
    self.embed = Frozen(target.matrix("embed"))
    self.lm_head = None if target.lm_head is None else Frozen(target.matrix("lm_head"))
    if self.reduced_vocab:
      d2t, t2d = vocab_lib.identity_vocab(spec.draft_vocab_size, c.vocab_size)
      self.d2t = VocabMap(jnp.asarray(d2t))
      self.t2d = VocabMap(jnp.asarray(t2d))
    else:
      self.d2t = self.t2d = None

  def set_draft_vocab(self, d2t: np.ndarray, *, target: Transformer | None = None) -> None:
    """Uses draft vocabulary `d2t` (`draft_vocab_from_counts`); the head is the target's."""
    del target  # the head columns are gathered from the frozen head at run time
    if not self.reduced_vocab:
      raise ConfigError("This drafter predicts over the full vocabulary"
                        " (draft_vocab_size=0); build it with a draft_vocab_size.")
    d2t = np.asarray(d2t, np.int32)
    if d2t.shape != (self.spec.draft_vocab_size,):
      raise ConfigError(f"d2t must have shape ({self.spec.draft_vocab_size},), got {d2t.shape}.")
    t2d = np.full((self.vocab_size,), -1, np.int32)
    t2d[d2t] = np.arange(d2t.size, dtype=np.int32)
    self.d2t = VocabMap(jnp.asarray(d2t))
    self.t2d = VocabMap(jnp.asarray(t2d))

  def drafter_config(self) -> dict:
    return self.spec.to_dict()

  def max_block_size(self) -> int | None:
    return self.block_size

  # ------------------------------------------------------------------ pieces
  def context(self, features: jax.Array) -> jax.Array:
    """Target taps [..., n_taps, D] -> context vectors [..., D]."""
    x = features.astype(self.fc[...].dtype)
    return self.stand_in(dense(x.reshape(x.shape[:-2] + (-1,)), self.fc[...]))

  def stand_in(self, hidden: jax.Array) -> jax.Array:
    """Hidden [..., D] -> context vector: the RMSNorm every context goes through."""
    return rms_norm(hidden, self.ctx_norm[...], self.eps)

  def _angles(self, positions: jax.Array):
    inv = layers.drafter_inverse_frequencies(self.spec, self.target_config)
    return rope_lib.rope_angles(positions, inv)

  def context_kv_rows(self) -> jax.Array:
    """The key and value columns of every layer's `wqkv` as rows [L, 2 KV, D] (`BlockState`).

    Sliced and transposed once per generation: inside the engine's loops XLA
    sliced and transposed them from the stacked parameters at every commit and
    every stage (docs/design.md §Work done once per generation).
    """
    return jnp.swapaxes(self.wqkv[...][..., self.spec.q_size:], 1, 2)

  def context_kv(self, ctx: jax.Array, positions: jax.Array, *,
                 kv_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Context vectors [..., D] at `positions` [...] -> keys, values [L, ..., K, H].

    `kv_rows` is `context_kv_rows()` when the caller has it (`BlockState.kv_rows`).
    """
    s = self.spec
    rows = self.context_kv_rows() if kv_rows is None else kv_rows
    kv = jnp.einsum("...d,led->l...e", ctx, rows)
    k, v = kv[..., :s.kv_size], kv[..., s.kv_size:]
    k = k.reshape(k.shape[:-1] + (s.num_kv_heads, s.head_dim))
    v = v.reshape(v.shape[:-1] + (s.num_kv_heads, s.head_dim))
    if self.k_norm is not None:
      scale = self.k_norm[...].reshape((s.num_layers,) + (1,) * (k.ndim - 2) + (s.head_dim,))
      k = rms_norm(k, jnp.ones((s.head_dim,), k.dtype), self.eps) * scale.astype(k.dtype)
    cos, sin = self._angles(positions)
    return _rope(k, cos, sin), v

  def draft_vocab_rows(self, w: jax.Array) -> jax.Array:
    """Rows [V, ...] of an output weight (one row per target id) -> the draft ids' [Vd, ...]."""
    return w if self.d2t is None else jnp.take(w, self.d2t[...], axis=0)

  def held_draft_vocab_rows(self, w: jax.Array | None) -> jax.Array | None:
    """`draft_vocab_rows(w)` for a drafter state, gathered once per generation; None over the
    full vocabulary (or without `w`): the parameter is then read in place, not copied into
    the state."""
    return None if self.d2t is None or w is None else self.draft_vocab_rows(w)

  def _head_rows(self) -> jax.Array:
    """The head as rows [Vd, D] (draft vocabulary only): no transposed copy of the embedding."""
    return self.draft_vocab_rows(self.embed[...] if self.lm_head is None
                                 else self.lm_head[...].T)

  def draft_logits(self, hidden: jax.Array, *, head_rows: jax.Array | None = None) -> jax.Array:
    """Block outputs [..., D] -> f32 logits over the draft vocabulary [..., Vd].

    `head_rows` is `_head_rows()` when the caller already has it.
    """
    rows = self._head_rows() if head_rows is None else head_rows
    return project_rows(rms_norm(hidden, self.final_norm[...], self.eps), rows)

  def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
    return draft_ids if self.d2t is None else self.d2t[...][draft_ids]

  def to_draft_ids(self, target_ids: jax.Array) -> jax.Array:
    """Target ids -> draft ids (-1 outside the draft vocabulary)."""
    return target_ids if self.t2d is None else self.t2d[...][target_ids]

  def to_target_probs(self, probs: jax.Array) -> jax.Array:
    """Draft-id probabilities [..., Vd] -> target vocabulary [..., V] (0 off the draft ids)."""
    return probs if self.d2t is None else layers.scatter_to_vocab(probs, self.d2t[...],
                                                                  self.vocab_size)

  def mask_input(self) -> jax.Array:
    """The mask input [D]: `mask_embed`, or the embedding of `spec.mask_token_id`."""
    if self.mask_embed is not None:
      return self.mask_embed[...]
    return self.embed[...][self.spec.mask_token_id].astype(self.fc[...].dtype)

  def block_inputs(self, anchor: jax.Array, block_size: int) -> jax.Array:
    """Anchor tokens [...] -> block inputs [..., 1 + gamma, D]: [embed(anchor), M x gamma]."""
    m = self.mask_input()
    emb = take_rows(self.embed[...], anchor).astype(m.dtype)
    mask = jnp.broadcast_to(m, anchor.shape + (block_size, emb.shape[-1]))
    return jnp.concatenate([emb[..., None, :], mask], axis=-2)

  def stage_inputs(self, anchor: jax.Array, block_size: int) -> jax.Array:
    """Anchor tokens [...] -> a stage's block inputs [..., Q, D]; the last gamma outputs draft."""
    return self.block_inputs(anchor, block_size - 1 if self.shifted else block_size)

  def layer_weights(self) -> tuple[dict[str, jax.Array], ...]:
    """Each layer's weights, sliced out of the parameters stacked on the layer axis."""
    stacked = {"attn_norm": self.attn_norm[...], "wqkv": self.wqkv[...], "wo": self.wo[...],
               "mlp_norm": self.mlp_norm[...], "w_gate_up": self.w_gate_up[...],
               "w_down": self.w_down[...]}
    if self.q_norm is not None:
      stacked.update(q_norm=self.q_norm[...], k_norm=self.k_norm[...])
    return tuple({name: w[i] for name, w in stacked.items()} for i in range(self.spec.num_layers))

  def drafting_layers(self) -> tuple[dict[str, jax.Array], ...]:
    """`layer_weights()` as a generation's drafting reads them (`BlockState.layers`).

    Sliced once per generation and carried in the state: XLA does not hoist a
    slice out of a loop (it counts as too cheap to be worth it), so slices of
    the stacked parameters inside the engine's round loop copied every layer
    matrix in every drafting stage (docs/design.md §Work done once per
    generation). The matrices are read in `draft_layer_dtype`,
    transposed ([N, K]) when that is a 16-bit dtype (`drafts_out_major`).
    """
    dtype = self.draft_layer_dtype
    if dtype is None:
      return self.layer_weights()
    out_major = self.drafts_out_major
    return tuple({name: ((w.T if out_major else w).astype(dtype) if name in _MATRICES else w)
                  for name, w in layer.items()} for layer in self.layer_weights())

  @property
  def drafts_out_major(self) -> bool:
    """Whether `drafting_layers` holds the matrices transposed (16-bit `draft_layer_dtype`)."""
    return self.draft_layer_dtype is not None and is_half(self.draft_layer_dtype)

  def run_blocks(self, x: jax.Array, *, positions: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                 ctx_mask: jax.Array, own_k: jax.Array | None = None,
                 own_v: jax.Array | None = None,
                 layer_weights: tuple[dict[str, jax.Array], ...] | None = None,
                 out_major: bool = False) -> jax.Array:
    """The decoder layers over query blocks.

    Args:
      x: [B, A, Q, D] block inputs (A blocks of Q = 1 + gamma).
      positions: [B, A, Q] RoPE positions.
      ctx_k, ctx_v: [L, B, C, K, H] shared context keys / values.
      ctx_mask: [B, A, C] context slots each block sees.
      own_k, own_v: optional [L, B, A, P, K, H] extra private keys per block
        (loop-aware training: the stand-in context of its earlier stages).
      layer_weights: `layer_weights()` when the caller has them (drafting:
        `BlockState.layers`).
      out_major: the matrices of `layer_weights` are transposed, [N, K]
        (`drafting_layers`).

    Returns:
      [B, A, Q, D] last layer outputs (before the final norm).
    """
    s = self.spec
    b, a, nq, _ = x.shape
    cos, sin = self._angles(positions)
    if layer_weights is None:
      layer_weights = self.layer_weights()
    eps = self.eps

    mm = dense_out_major if out_major else dense

    def layer(h, w, ck, cv, ok, ov):
      qkv = mm(rms_norm(h, w["attn_norm"], eps), w["wqkv"])
      q = qkv[..., :s.q_size].reshape(b, a, nq, s.num_heads, s.head_dim)
      k = qkv[..., s.q_size:s.q_size + s.kv_size].reshape(b, a, nq, s.num_kv_heads, s.head_dim)
      v = qkv[..., s.q_size + s.kv_size:].reshape(b, a, nq, s.num_kv_heads, s.head_dim)
      if "q_norm" in w:
        q = rms_norm(q, w["q_norm"], eps)
        k = rms_norm(k, w["k_norm"], eps)
      q, k = _rope(q, cos, sin), _rope(k, cos, sin)
      if ok is not None:
        k = jnp.concatenate([ok, k], axis=2)
        v = jnp.concatenate([ov, v], axis=2)
      out = layers.block_attention(q, ctx_k=ck, ctx_v=cv, ctx_mask=ctx_mask, own_k=k, own_v=v)
      h = h + mm(out, w["wo"])
      return h + layers.swiglu(rms_norm(h, w["mlp_norm"], eps), w["w_gate_up"], w["w_down"],
                               dense=mm)

    # Unrolled (a drafter has a few layers): a scan would re-slice (and, for
    # 16-bit weights on XLA:CPU, re-convert) every layer's matrices per stage.
    h = x
    for i, w in enumerate(layer_weights):
      h = layer(h, w, ctx_k[i], ctx_v[i],
                None if own_k is None else own_k[i], None if own_v is None else own_v[i])
    return h

  # -------------------------------------------------------------- interface
  def init_state(self, *, batch_size: int, capacity: int) -> BlockState:
    s = self.spec
    kv = jnp.zeros((s.num_layers, batch_size, capacity, s.num_kv_heads, s.head_dim),
                   self.fc[...].dtype)
    zeros = jnp.zeros((batch_size,), jnp.int32)
    return BlockState(k=kv, v=kv, lengths=zeros, anchor=zeros, committed_anchor=zeros,
                      head_rows=self._head_rows().astype(DRAFT_HEAD_DTYPE),
                      layers=self.drafting_layers(), kv_rows=self.context_kv_rows())

  def _write_context(self, state: BlockState, ctx: jax.Array, starts: jax.Array) -> BlockState:
    """Writes context vectors [B, W, D] at slots `starts + t` of every layer."""
    positions = starts[:, None] + jnp.arange(ctx.shape[1])[None, :]
    k, v = self.context_kv(ctx, positions, kv_rows=state.kv_rows)
    write = jax.vmap(kv_lib.write_rows, in_axes=(0, 0, None))
    return state.replace(k=write(state.k, k, starts), v=write(state.v, v, starts))

  def commit(self, state, *, tokens, features, next_tokens, starts, counts):
    del tokens
    state = self._write_context(state, self.context(features), starts)
    last = jnp.take_along_axis(next_tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    anchor = jnp.where(counts > 0, last, state.committed_anchor).astype(jnp.int32)
    return state.replace(lengths=(starts + counts).astype(jnp.int32), anchor=anchor,
                         committed_anchor=anchor)

  def backbone_stage(self, state: BlockState, block_size: int) -> tuple[BlockState, jax.Array]:
    """The block forward of one stage, after everything the state holds.

    Writes the stand-in context of the stage's positions n .. n + gamma - 1 and
    advances `lengths` by gamma; the caller picks the drafts and sets `anchor`
    to the last one.

    Returns:
      (state, h [B, gamma, D] the outputs that predict the gamma drafts).
    """
    n = state.lengths
    capacity = state.k.shape[2]
    x = self.stage_inputs(state.anchor, block_size)[:, None]  # [B, 1, Q, D]
    positions = (n[:, None] + jnp.arange(x.shape[2])[None, :])[:, None]
    ctx_mask = (jnp.arange(capacity)[None, :] < n[:, None])[:, None]  # [B, 1, C]
    h = self.run_blocks(x, positions=positions, ctx_k=state.k, ctx_v=state.v,
                        ctx_mask=ctx_mask, layer_weights=state.layers,
                        out_major=self.drafts_out_major)[:, 0, -block_size:]
    # Stand-in context for the unverified positions n .. n + gamma - 1 (next stage).
    state = self._write_context(state, self.stand_in(h), n)
    return state.replace(lengths=n + block_size), h

  supports_trees = True

  def draft_tree_stage(self, state, *, block_size, budget):
    del budget  # the engine takes the top prefixes of the marginals
    # The block's outputs (and so the stand-in context) do not depend on the
    # tokens drafted: the best path only decides the next anchor.
    state, h = self.backbone_stage(state, block_size)
    logits = self.draft_logits(h, head_rows=state.head_rows)
    best_last = self.to_target_ids(jnp.argmax(logits[:, -1], axis=-1)).astype(jnp.int32)
    vocab = None if self.d2t is None else self.d2t[...].astype(jnp.int32)
    return (state.replace(anchor=best_last),
            TreeStage(logprobs=jax.nn.log_softmax(logits.astype(jnp.float32)), vocab=vocab))

  def draft_stage(self, state, *, key, block_size, sampling):
    state, h = self.backbone_stage(state, block_size)
    logits = self.draft_logits(h, head_rows=state.head_rows)
    draft_ids = sampling_lib.next_token(key, logits, sampling)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), draft_ids[..., None],
                                   axis=-1)[..., 0]
    probs = None
    if not sampling.greedy:
      probs = self.to_target_probs(sampling_lib.processed_probs(logits, sampling))
    tokens = self.to_target_ids(draft_ids).astype(jnp.int32)
    state = state.replace(anchor=tokens[:, -1])
    return state, DraftStage(tokens=tokens, logprobs=logprobs, probs=probs)

  # --------------------------------------------------------------- training
  def train_stages(self, *, tokens: jax.Array, features: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, anchors: jax.Array, block_size: int,
                   num_stages: int) -> list[jax.Array]:
    """Block outputs of `num_stages` chained stages after each anchor (ground-truth anchors).

    Stage s of anchor a reads token x_{a + s*gamma} and masks at positions
    a + s*gamma + 1 .. a + (s+1)*gamma (shifted: .. a + (s+1)*gamma - 1); its
    drafts predict x_{a + s*gamma + 1} .. x_{a + (s+1)*gamma}. It sees the target
    context of positions < a in a's segment, and (s >= 1) the stand-in context of its own chain's
    earlier stages at positions a .. a + s*gamma - 1, computed from those
    stages' outputs exactly as `draft_stage` does at inference.

    Args:
      tokens: [B, T] int32.
      features: [B, T, n_taps, D].
      positions: [B, T] positions within each example.
      segment_ids: [B, T].
      anchors: [B, A] anchor indices into T.
      block_size: gamma (static).
      num_stages: stages per anchor (static).

    Returns:
      num_stages arrays [B, A, gamma, D]: outputs at the mask positions.
    """
    b, t = tokens.shape
    ctx_k, ctx_v = self.context_kv(self.context(features), positions)  # [L, B, T, K, H]
    seg_a = jnp.take_along_axis(segment_ids, anchors, axis=1)
    ctx_mask = ((jnp.arange(t)[None, None, :] < anchors[..., None])
                & (segment_ids[:, None, :] == seg_a[..., None]))  # [B, A, T]
    pos_a = jnp.take_along_axis(positions, anchors, axis=1)  # [B, A]
    own_k = own_v = None
    outs = []
    for s in range(num_stages):
      offset = s * block_size
      anchor_tok = jnp.take_along_axis(tokens, jnp.clip(anchors + offset, 0, t - 1), axis=1)
      x = self.stage_inputs(anchor_tok, block_size)
      qpos = pos_a[..., None] + offset + jnp.arange(x.shape[-2])
      h = self.run_blocks(x, positions=qpos, ctx_k=ctx_k, ctx_v=ctx_v, ctx_mask=ctx_mask,
                          own_k=own_k, own_v=own_v)[:, :, -block_size:]
      outs.append(h)
      if s + 1 < num_stages:
        k, v = self.context_kv(self.stand_in(h), qpos[..., :block_size])  # [L, B, A, gamma, K, H]
        own_k = k if own_k is None else jnp.concatenate([own_k, k], axis=3)
        own_v = v if own_v is None else jnp.concatenate([own_v, v], axis=3)
    return outs
