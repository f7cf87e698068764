"""EAGLE-3 drafter (autoregressive): one decoder layer over [token ; feature].

Per position p the drafter reads a pair (feature_p, token_{p+1}) and outputs
its own hidden state g_p, which predicts token_{p+2}:

    feature_p = fc(concat of the target's tapped hidden states at p)   (committed p)
              = g_{p-1}, the drafter's own previous output              (drafted p)
    x_p       = [RMSNorm(embed(token_{p+1})) ; RMSNorm(feature_p)]      [2D]
    q, k, v   = x_p @ wqkv                                              (from 2D)
    h         = feature_p + attn(q, k, v) @ wo                          (residual on
                                                                         the feature)
    g_p       = h + MLP(RMSNorm(h))                                     [D]
    logits    = RMSNorm(g_p) @ lm_head                                  [Vd]
                (g_p @ lm_head with `norm_output` off, as SpecForge allows)

The layer rotates q and k with the drafter's own RoPE when its spec has one
(`rope_theta`, `rope_scaling`: upstream EAGLE-3 drafters rotate with theta
10000 and no scaling whatever the target does), else with the target's.

The token embedding is the target's (frozen); the LM head is the drafter's own
(trained, initialised from the target's head) over a reduced draft vocabulary
of the most frequent target tokens (`vocab.py`); drafts are mapped back to
target ids.

Decoding state (an explicit pytree, `Eagle3State`): the layer's KV cache, one
slot per pair, and the last output hidden state. After `commit` the last
committed pair (feature_{n-1}, x_n) has been read, so its output predicts the
first draft directly; a stage drafts gamma tokens with gamma - 1 forwards and
leaves its last draft *pending* (read first by the next stage, if DLoop drafts
one). Later DLoop stages simply continue the chain on the drafter's own hidden
states.

    slot        0          ..  n-1                 n           n+1
    pair        (f_0, x_1) ..  (f_{n-1}, x_n)      (g_{n-1}, d_1)  (g_n, d_2)
    output      g_0            g_{n-1} -> d_1      g_n -> d_2      g_{n+1} -> d_3
                |-- commit (target features) ---|  |-- draft_stage (own hidden) ---|
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.drafters import layers
from dloop_jax.drafters import vocab as vocab_lib
from dloop_jax.decoding.drafter import Drafter, DraftStage, TreeStage
from dloop_jax.drafters.base import Frozen, VocabMap
from dloop_jax.drafters.spec import DrafterSpec
from dloop_jax.drafters.vocab import draft_vocab_from_counts, token_counts  # noqa: F401 (re-exported)
from dloop_jax.errors import ConfigError
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models import rope as rope_lib
from dloop_jax.models.transformer import (Transformer, attention, dense, f32_dot_general,
                                          rms_norm, take_rows)

# Dynamic draft trees: frontier nodes expanded per depth, and children kept per
# node (EAGLE-2's top-k, 10 there); capped by the tree budget. At 8 a depth-4
# tree has 32 candidates and B = 32 chose like B = 16 (docs/benchmarks.md).
TREE_WIDTH = 16


@struct.dataclass
class Eagle3State:
  """EAGLE-3 decoding state.

  Attributes:
    k: [B, C, K, H] keys of the layer, slot p = pair p.
    v: [B, C, K, H] values.
    lengths: [B] pairs read (slots in use).
    hidden: [B, D] output at slot `lengths - 1`: predicts the next draft.
    committed_hidden: [B, D] `hidden` after the last commit (restored for rows
      a commit leaves unchanged).
    pending: [B] last draft of the previous stage, not read yet.
    has_pending: [] bool, whether `pending` must be read before drafting
      (false right after a commit; the same for all rows).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  hidden: jax.Array
  committed_hidden: jax.Array
  pending: jax.Array
  has_pending: jax.Array


class Eagle3Drafter(Drafter):
  """EAGLE-3: fc over 3 target taps, one decoder layer, reduced-vocab head."""

  def __init__(self, spec: DrafterSpec, *, target: Transformer, rngs: nnx.Rngs):
    if spec.num_layers != 1:
      raise ConfigError(f"An EAGLE-3 drafter has exactly one decoder layer; got num_layers="
                        f"{spec.num_layers}.")
    c = target.config
    d, dtype = c.hidden_size, target.dtype
    self.spec = spec
    self.kind = "autoregressive"
    self.taps = tuple(spec.taps)
    self.block_size = spec.block_size
    self.target_fingerprint = tuple(sorted(c.fingerprint.items()))
    self.name = "eagle3"
    self.vocab_size = c.vocab_size
    self.eps = c.rms_norm_eps
    self.target_config = c
    self.reduced_vocab = 0 < spec.draft_vocab_size < c.vocab_size
    vd = spec.draft_vocab_size if self.reduced_vocab else c.vocab_size
    self.draft_vocab_size = vd

    n_taps = len(spec.taps)
    self.fc = nnx.Param(layers.init_weight(rngs, (n_taps * d, d), fan_in=n_taps * d, dtype=dtype))
    self.input_norm = nnx.Param(jnp.ones((d,), dtype))
    self.hidden_norm = nnx.Param(jnp.ones((d,), dtype))
    self.wqkv = nnx.Param(layers.init_weight(
        rngs, (2 * d, spec.q_size + 2 * spec.kv_size), fan_in=2 * d, dtype=dtype))
    self.q_norm = nnx.Param(jnp.ones((spec.head_dim,), dtype)) if spec.qk_norm else None
    self.k_norm = nnx.Param(jnp.ones((spec.head_dim,), dtype)) if spec.qk_norm else None
    # Output projections start small: the layer begins near the identity on the
    # feature stream, which the (pretrained) head can already read.
    self.wo = nnx.Param(layers.init_weight(rngs, (spec.q_size, d), fan_in=spec.q_size,
                                           dtype=dtype, scale=0.5))
    self.mlp_norm = nnx.Param(jnp.ones((d,), dtype))
    self.w_gate_up = nnx.Param(layers.init_weight(
        rngs, (d, 2 * spec.intermediate_size), fan_in=d, dtype=dtype))
    self.w_down = nnx.Param(layers.init_weight(
        rngs, (spec.intermediate_size, d), fan_in=spec.intermediate_size, dtype=dtype, scale=0.5))
    self.final_norm = nnx.Param(jnp.asarray(target.final_norm[...], dtype))
    self.embed = Frozen(target.matrix("embed"))
    if self.reduced_vocab:
      d2t, t2d = vocab_lib.identity_vocab(vd, c.vocab_size)
      self.d2t = VocabMap(jnp.asarray(d2t))
      self.t2d = VocabMap(jnp.asarray(t2d))
    else:
      self.d2t = self.t2d = None
    self.lm_head = nnx.Param(self._target_head_columns(target))

  # ------------------------------------------------------------ construction
  def _target_head_columns(self, target: Transformer) -> jax.Array:
    head = target.matrix("embed").T if target.lm_head is None else target.matrix("lm_head")
    if self.d2t is not None:
      head = head[:, self.d2t[...]]
    return jnp.asarray(head, target.dtype)

  def set_draft_vocab(self, d2t: np.ndarray, *, target: Transformer) -> None:
    """Uses draft vocabulary `d2t` (`draft_vocab_from_counts`); resets the head to the target's columns.

    Call it before training (the head is trained for one vocabulary).
    """
    if not self.reduced_vocab:
      raise ConfigError("This drafter predicts over the full vocabulary"
                        " (draft_vocab_size=0); build it with a draft_vocab_size.")
    d2t = np.asarray(d2t, np.int32)
    if d2t.shape != (self.draft_vocab_size,):
      raise ConfigError(f"d2t must have shape ({self.draft_vocab_size},), got {d2t.shape}.")
    t2d = np.full((self.vocab_size,), -1, np.int32)
    t2d[d2t] = np.arange(d2t.size, dtype=np.int32)
    self.d2t = VocabMap(jnp.asarray(d2t))
    self.t2d = VocabMap(jnp.asarray(t2d))
    self.lm_head = nnx.Param(self._target_head_columns(target))

  def drafter_config(self) -> dict:
    return self.spec.to_dict()

  # ------------------------------------------------------------------ pieces
  def fuse(self, features: jax.Array) -> jax.Array:
    """Target taps [..., n_taps, D] -> fused feature [..., D]."""
    x = features.astype(self.fc[...].dtype)
    return dense(x.reshape(x.shape[:-2] + (-1,)), self.fc[...])

  def draft_logits(self, hidden: jax.Array) -> jax.Array:
    """Own hidden [..., D] -> f32 logits over the draft vocabulary [..., Vd]."""
    x = rms_norm(hidden, self.final_norm[...], self.eps) if self.spec.norm_output else hidden
    return f32_dot_general(x, self.lm_head[...], (((x.ndim - 1,), (0,)), ((), ())))

  def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
    return draft_ids if self.d2t is None else self.d2t[...][draft_ids]

  def to_draft_ids(self, target_ids: jax.Array) -> jax.Array:
    """Target ids -> draft ids (-1 outside the draft vocabulary)."""
    return target_ids if self.t2d is None else self.t2d[...][target_ids]

  def _qkv(self, tokens: jax.Array, feature: jax.Array, positions: jax.Array):
    """q [B, T, N, H], k, v [B, T, K, H] of pairs (feature [B, T, D], token [B, T])."""
    s = self.spec
    b, t = tokens.shape
    emb = take_rows(self.embed[...], tokens).astype(feature.dtype)
    x = jnp.concatenate([rms_norm(emb, self.input_norm[...], self.eps),
                         rms_norm(feature, self.hidden_norm[...], self.eps)], axis=-1)
    qkv = dense(x, self.wqkv[...])
    q = qkv[..., :s.q_size].reshape(b, t, s.num_heads, s.head_dim)
    k = qkv[..., s.q_size:s.q_size + s.kv_size].reshape(b, t, s.num_kv_heads, s.head_dim)
    v = qkv[..., s.q_size + s.kv_size:].reshape(b, t, s.num_kv_heads, s.head_dim)
    if self.q_norm is not None:
      q = rms_norm(q, self.q_norm[...], self.eps)
      k = rms_norm(k, self.k_norm[...], self.eps)
    cos, sin = rope_lib.rope_angles(positions, layers.drafter_inverse_frequencies(
        s, self.target_config))
    return rope_lib.apply_rope(q, cos, sin), rope_lib.apply_rope(k, cos, sin), v

  def _finish(self, feature: jax.Array, attn_out: jax.Array) -> jax.Array:
    h = feature + dense(attn_out, self.wo[...])
    return h + layers.swiglu(rms_norm(h, self.mlp_norm[...], self.eps), self.w_gate_up[...],
                             self.w_down[...])

  def _forward_cached(self, state: Eagle3State, tokens: jax.Array, feature: jax.Array,
                      starts: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reads W pairs per row into slots `starts + t`; returns (outputs [B, W, D], k, v)."""
    w = tokens.shape[1]
    positions = starts[:, None] + jnp.arange(w)[None, :]
    q, k, v = self._qkv(tokens, feature, positions)
    k_all = kv_lib.write_rows(state.k, k, starts)
    v_all = kv_lib.write_rows(state.v, v, starts)
    mask = kv_lib.attention_mask(starts=starts, num_new=w, capacity=state.k.shape[1])
    return self._finish(feature, attention(q, k_all, v_all, mask)), k_all, v_all

  # -------------------------------------------------------------- interface
  def forwards_per_stage(self, block_size: int, *, first: bool) -> int:
    """gamma - 1 layer forwards, plus one reading the previous stage's pending draft.

    The first draft comes from the hidden state already computed (by the commit
    or by reading the pending draft): only the head runs for it. The first stage
    of a round follows a commit, so it has nothing pending.
    """
    return block_size - 1 + (0 if first else 1)

  def init_state(self, *, batch_size: int, capacity: int) -> Eagle3State:
    s = self.spec
    dtype = self.fc[...].dtype
    d = self.fc[...].shape[1]
    kv = jnp.zeros((batch_size, capacity, s.num_kv_heads, s.head_dim), dtype)
    zeros_d = jnp.zeros((batch_size, d), dtype)
    return Eagle3State(k=kv, v=kv, lengths=jnp.zeros((batch_size,), jnp.int32),
                       hidden=zeros_d, committed_hidden=zeros_d,
                       pending=jnp.zeros((batch_size,), jnp.int32),
                       has_pending=jnp.zeros((), bool))

  def commit(self, state, *, tokens, features, next_tokens, starts, counts):
    del tokens  # the drafter pairs each feature with the token that follows it
    feature = self.fuse(features)
    out, k, v = self._forward_cached(state, next_tokens, feature, starts)
    last = jnp.take_along_axis(out, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    hidden = jnp.where((counts > 0)[:, None], last, state.committed_hidden)
    return Eagle3State(k=k, v=v, lengths=(starts + counts).astype(jnp.int32), hidden=hidden,
                       committed_hidden=hidden, pending=state.pending,
                       has_pending=jnp.zeros((), bool))

  def _read_pending(self, state: Eagle3State) -> Eagle3State:
    out, k, v = self._forward_cached(state, state.pending[:, None], state.hidden[:, None],
                                     state.lengths)
    return state.replace(k=k, v=v, hidden=out[:, 0], lengths=state.lengths + 1)

  def _sample(self, hidden, key, sampling):
    logits = self.draft_logits(hidden)  # [B, Vd]
    draft_ids = sampling_lib.next_token(key, logits, sampling)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), draft_ids[:, None], axis=1)[:, 0]
    probs = None
    if not sampling.greedy:
      probs = sampling_lib.processed_probs(logits, sampling)
      if self.d2t is not None:
        probs = layers.scatter_to_vocab(probs, self.d2t[...], self.vocab_size)
    return self.to_target_ids(draft_ids), logprob, probs

  def draft_stage(self, state, *, key, block_size, sampling):
    state = jax.lax.cond(state.has_pending, self._read_pending, lambda st: st, state)
    keys = jax.random.split(key, block_size)

    def step(st, step_key):
      token, logprob, probs = self._sample(st.hidden, step_key, sampling)
      st = self._read_pending(st.replace(pending=token))
      return st, (token, logprob, probs)

    tokens, logprobs, probs = [], [], []
    if block_size > 1:
      state, (t, lp, pr) = jax.lax.scan(step, state, keys[:-1])
      tokens, logprobs = [t.T], [lp.T]
      probs = [] if pr is None else [jnp.swapaxes(pr, 0, 1)]
    token, logprob, prob = self._sample(state.hidden, keys[-1], sampling)
    tokens.append(token[:, None])
    logprobs.append(logprob[:, None])
    if prob is not None:
      probs.append(prob[:, None])
    state = state.replace(pending=token, has_pending=jnp.ones((), bool))
    return state, DraftStage(
        tokens=jnp.concatenate(tokens, axis=1), logprobs=jnp.concatenate(logprobs, axis=1),
        probs=jnp.concatenate(probs, axis=1) if probs else None)

  # ------------------------------------------------------------ draft trees
  supports_trees = True

  def draft_tree_stage(self, state, *, block_size, budget):
    """A dynamic draft tree (EAGLE-2) of depth gamma: one batched forward per depth.

    The beam of depth d holds the W = min(budget, TREE_WIDTH, Vd) best
    prefixes of that depth by path log-probability. One drafter forward reads
    the pairs (parent's hidden state, own token) of all W nodes at once, at
    position n + d - 1 (n = `lengths`), each seeing the committed slots and
    its own ancestors' pairs (kept in a scratch buffer beside the cache: the
    tree mask); its W outputs give each node's top W children, and the W best
    of the W * W children by path log-probability are the beam of depth d + 1.
    The last depth needs no forward: gamma - 1 forwards, as a chain stage.

    The state then continues along the best path (the best prefix of depth
    gamma): its pairs of depths 1..gamma - 1 are written to the cache at slots
    n .. n + gamma - 2 and its last token is pending, exactly the state after
    drafting that path as a chain (a node's hidden state is computed over its
    ancestors only, as a chain's over its prefix).
    """
    state = jax.lax.cond(state.has_pending, self._read_pending, lambda st: st, state)
    gamma = block_size
    b, d_model = state.hidden.shape
    w = min(budget, TREE_WIDTH, self.draft_vocab_size)
    n = state.lengths
    capacity = state.k.shape[1]
    scratch = (gamma - 1) * w
    cache_mask = jnp.broadcast_to((jnp.arange(capacity)[None, :] < n[:, None])[:, None, :],
                                  (b, w, capacity))

    root_lp = jax.nn.log_softmax(self.draft_logits(state.hidden))  # [B, Vd]
    score, token = jax.lax.top_k(root_lp, w)  # [B, W] best first
    token = token.astype(jnp.int32)
    parent_slot = jnp.full((b, w), -1, jnp.int32)
    feature = jnp.broadcast_to(state.hidden[:, None], (b, w, d_model))  # parents' hidden
    sk = jnp.zeros((b, scratch) + state.k.shape[2:], state.k.dtype)
    sv = jnp.zeros_like(sk)
    anc = jnp.zeros((b, w, scratch), bool)  # scratch slots each beam node sees
    tokens, scores, parents, hiddens = [token], [score], [parent_slot], []
    for depth in range(1, gamma):
      at = (depth - 1) * w
      positions = jnp.broadcast_to((n + depth - 1)[:, None], (b, w))
      q, k, v = self._qkv(self.to_target_ids(token), feature, positions)
      sk = sk.at[:, at:at + w].set(k)
      sv = sv.at[:, at:at + w].set(v)
      anc = anc.at[:, :, at:at + w].set(jnp.eye(w, dtype=bool)[None])
      mask = jnp.concatenate([cache_mask, anc], axis=-1)
      out = attention(q, jnp.concatenate([state.k, sk], axis=1),
                      jnp.concatenate([state.v, sv], axis=1), mask)
      h = self._finish(feature, out)  # [B, W, D]
      hiddens.append(h)
      child_lp, child = jax.lax.top_k(jax.nn.log_softmax(self.draft_logits(h)), w)  # [B, W, W]
      cand = score[:, :, None] + child_lp
      score, flat = jax.lax.top_k(cand.reshape(b, w * w), w)
      parent_slot = (flat // w).astype(jnp.int32)
      token = jnp.take_along_axis(child.reshape(b, w * w), flat, axis=1).astype(jnp.int32)
      feature = jnp.take_along_axis(h, parent_slot[:, :, None], axis=1)
      anc = jnp.take_along_axis(anc, parent_slot[:, :, None], axis=1)
      tokens.append(token)
      scores.append(score)
      parents.append(parent_slot)

    # The best path, from slot 0 of the last depth back to the root.
    slot = jnp.zeros((b,), jnp.int32)
    slots = [slot]
    for depth in range(gamma - 1, 0, -1):
      slot = jnp.take_along_axis(parents[depth], slot[:, None], axis=1)[:, 0]
      slots.append(slot)
    slots = slots[::-1]  # [gamma] x [B]: the path's slot at depths 1..gamma
    best = jnp.stack([jax.nn.one_hot(sl, w, dtype=bool) for sl in slots], axis=1)
    if gamma > 1:
      path = (jnp.arange(gamma - 1)[None, :] * w + jnp.stack(slots[:-1], axis=1))  # [B, gamma-1]
      pk = jnp.take_along_axis(sk, path[:, :, None, None], axis=1)
      pv = jnp.take_along_axis(sv, path[:, :, None, None], axis=1)
      state = state.replace(
          k=kv_lib.write_rows(state.k, pk, n), v=kv_lib.write_rows(state.v, pv, n),
          hidden=jnp.take_along_axis(hiddens[-1], slots[-2][:, None, None], axis=1)[:, 0],
          lengths=n + gamma - 1)
    cands = tree_lib.Candidates(
        tokens=self.to_target_ids(jnp.stack(tokens, axis=1)).astype(jnp.int32),
        scores=jnp.stack(scores, axis=1), parents=jnp.stack(parents, axis=1), best=best)
    last = self.to_target_ids(tokens[-1][:, 0]).astype(jnp.int32)
    state = state.replace(pending=last, has_pending=jnp.ones((), bool))
    return state, TreeStage(candidates=cands)

  # --------------------------------------------------------------- training
  def ttt_hiddens(self, *, tokens: jax.Array, features: jax.Array, positions: jax.Array,
                  segment_ids: jax.Array, num_steps: int) -> jax.Array:
    """Training-time test: `num_steps` unrolled drafting steps at every position at once.

    Step i at index t plays the drafting step that continues i steps past the
    committed pair (f_t, x_{t+1}): it reads token x_{t+1+i} (ground truth) and
    the drafter's own step-(i-1) output there (step 0: fc(f_t)), sits at RoPE
    position `positions[t] + i`, and predicts x_{t+2+i}. Its query sees the
    target-conditioned step-0 keys of positions <= t in its segment, plus one
    key per earlier step at its own index (the diagonal blocks): exactly the
    slots an inference query i steps into a stage sees.

    Keys seen by step 2 at index t = 2 (T = 4; 'x' = visible):

        step-0 keys (index)   0 1 2 3  |  step-1 key  step-2 key (index 2 only)
        step 2, t = 2         x x x .  |  x           x

    Args:
      tokens: [B, T] int32.
      features: [B, T, n_taps, D] target taps after reading tokens[t].
      positions: [B, T] positions within each example.
      segment_ids: [B, T] (0 = padding).
      num_steps: unrolled steps (static).

    Returns:
      [num_steps, B, T, D] outputs of every step (own hidden states).
    """
    b, t = tokens.shape
    idx = jnp.arange(t)
    causal = ((idx[None, :, None] >= idx[None, None, :])
              & (segment_ids[:, :, None] == segment_ids[:, None, :]))  # [B, Tq, Tk]
    feature = self.fuse(features)
    diag_k, diag_v, outs = [], [], []
    k0 = v0 = None
    for i in range(num_steps):
      step_tokens = jnp.pad(tokens[:, 1 + i:], ((0, 0), (0, min(1 + i, t))))[:, :t]
      q, k, v = self._qkv(step_tokens, feature, positions + i)
      if i == 0:
        k0, v0 = k, v
      else:
        diag_k.append(k)
        diag_v.append(v)
      feature = self._finish(feature, _ttt_attention(q, k0, v0, causal, diag_k, diag_v))
      outs.append(feature)
    return jnp.stack(outs)


def _ttt_attention(q, k0, v0, mask0, diag_k, diag_v):
  """Queries [B, T, N, H] over step-0 keys (masked [B, T, T]) and diagonal keys.

  Returns [B, T, N * H].
  """
  b, t, n, h = q.shape
  kv = k0.shape[2]
  q = q.reshape(b, t, kv, n // kv, h)
  scale = h ** -0.5
  s0 = jnp.einsum("btkgh,bckh->bkgtc", q, k0).astype(jnp.float32) * scale
  s0 = jnp.where(mask0[:, None, None], s0, layers.NEG_INF)
  parts = [s0]
  for k in diag_k:
    parts.append((jnp.einsum("btkgh,btkh->bkgt", q, k).astype(jnp.float32) * scale)[..., None])
  probs = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
  out = jnp.einsum("bkgtc,bckh->btkgh", probs[..., :t].astype(v0.dtype), v0)
  for i, v in enumerate(diag_v):
    p = jnp.moveaxis(probs[..., t + i], 3, 1)  # [B, T, K, G]
    out = out + p[..., None].astype(v.dtype) * v[:, :, :, None, :]
  return out.reshape(b, t, n * h)
