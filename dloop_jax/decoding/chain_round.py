"""Chains of drafts: DLoop's gated stages, and their verification.

Per round, for every row b (rows are independent; no minimum over the batch):

    committed: x_0 .. x_n       (x_n = `pending`, not yet read by the target)
    drafts:    d_1 .. d_{s_b * gamma}    from s_b gated stages: another stage
               while the gate passes the stage just drafted (`gate.decide`),
               at most S_max (S_max = 1: "sd")
    lookup:    a row whose first draft the drafter is unsure of, and whose
               newest tokens occurred earlier, verifies the tokens that
               followed them instead (`decoding.lookup`)
    verify:    target([x_n, d_1, ..., d_m]) of a compiled width 1 + m,
               m >= the drafts any row verifies; accept the longest matching
               prefix (greedy) or by rejection sampling, plus the bonus token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.decoding import verify as verify_lib
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.decoding.proposal import Proposal
from dloop_jax.models import kv_cache as kv_lib
from dloop_jax.models.transformer import Transformer


@struct.dataclass
class Chain:
  """The drafts of every row, in order.

  Attributes:
    tokens: [B, S_max * gamma] int32, padding past a row's `Proposal.num_drafts`.
    probs: [B, S_max * gamma, V] f32 their draft distributions (sampling only, else None).
  """

  tokens: jax.Array
  probs: jax.Array | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainProposer:
  """Gated chain drafting (`proposal.Proposer`).

  Attributes:
    target, drafter: the models.
    block_size: gamma.
    max_stages: S_max (1: one stage, no gate).
    sampling: the sampling configuration.
    gate: DLoop's gate.
    scored: compute the scheduler's c_k (schedule "cost").
    use_learned: traced bool, c_k from the drafter's learned confidence.
    lookup_min_match, lookup_max_probability: the lookup rule (`lookup.fires`).
  """

  target: Transformer
  drafter: Drafter
  block_size: int
  max_stages: int
  sampling: sampling_lib.SamplingConfig
  gate: gate_lib.Gate
  scored: bool
  use_learned: jax.Array
  lookup_min_match: int = 0
  lookup_max_probability: float = 0.0

  @property
  def causal(self) -> bool:
    # Sampling verifies a prefix whose acceptance is decided depth by depth.
    return not self.sampling.greedy

  @property
  def width(self) -> int:
    """The most drafts of a round."""
    return self.max_stages * self.block_size

  def propose(self, drafter_state: Any, *, going: jax.Array, key: jax.Array,
              lookup: lookup_lib.Proposal | None) -> tuple[Any, Proposal]:
    b, gamma = going.shape[0], self.block_size
    drafts0 = jnp.zeros((b, self.width), jnp.int32)
    conf0 = jnp.zeros((b, self.width), jnp.float32)
    probs0 = (None if self.sampling.greedy else
              jnp.zeros((b, self.width, self.target.config.vocab_size), jnp.float32))

    def cond(c):
      stage, _, _, _, _, _, going, _, _ = c
      return (stage < self.max_stages) & jnp.any(going)

    def body(c):
      stage, dstate, drafts, conf, probs, num_stages, going, looked_up, outlook = c
      dstate, drafted = self.drafter.draft_stage(
          dstate, key=jax.random.fold_in(key, stage), block_size=gamma, sampling=self.sampling)
      drafts = jax.lax.dynamic_update_slice(drafts, drafted.tokens.astype(jnp.int32),
                                            (0, stage * gamma))
      if self.scored:
        c_k = schedule_lib.draft_confidence(logprobs=drafted.logprobs, probs=drafted.probs,
                                            config=self.sampling)
        if drafted.confidence is not None:  # a traced choice: no recompile when switched
          c_k = jnp.where(self.use_learned, drafted.confidence.astype(jnp.float32), c_k)
        conf = jax.lax.dynamic_update_slice(conf, c_k, (0, stage * gamma))
      if probs is not None:
        probs = jax.lax.dynamic_update_slice(probs, drafted.probs.astype(jnp.float32),
                                             (0, stage * gamma, 0))
      num_stages = num_stages + going
      if lookup is not None:
        # Decided from the first stage only; a row that takes the lookup's
        # drafts stops there, since later stages continue the drafter's own.
        looked_up = looked_up | ((stage == 0) & lookup_lib.fires(
            proposal=lookup, first_logprob=drafted.logprobs[:, 0], drafting=going,
            min_match=self.lookup_min_match, max_probability=self.lookup_max_probability))
        going = going & ~looked_up
      if self.max_stages > 1:
        learned = (None if drafted.confidence is None else
                   gate_lib.learned_stage_confidence(drafted.confidence))
        more, outlook = gate_lib.decide(
            self.gate, outlook, score=gate_lib.stage_confidence(drafted.logprobs),
            learned_score=learned, stages_done=stage + 1, max_stages=self.max_stages)
        going = going & more
      else:
        going = jnp.zeros_like(going)
      return stage + 1, dstate, drafts, conf, probs, num_stages, going, looked_up, outlook

    zeros = jnp.zeros((b,), jnp.int32)
    _, drafter_state, drafts, conf, probs, num_stages, _, looked_up, _ = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), drafter_state, drafts0, conf0, probs0, zeros,
                     going, jnp.zeros((b,), bool), gate_lib.Outlook.start(b)))
    num_drafts = num_stages * gamma
    if lookup is not None:
      # The lookup's drafts replace the drafter's, up to the round's whole
      # draft width; a short proposal is fewer drafts. The scheduler takes
      # them as certain: the rule that fires the lookup was measured with
      # every lookup draft verified.
      drafts = jnp.where(looked_up[:, None], lookup.tokens, drafts)
      conf = jnp.where(looked_up[:, None], 1.0, conf)
      num_drafts = jnp.where(looked_up, lookup.num_tokens, num_drafts)
    return drafter_state, Proposal(drafts=Chain(tokens=drafts, probs=probs), confidence=conf,
                                   num_drafts=num_drafts, num_stages=num_stages,
                                   looked_up=looked_up)

  def verify(self, proposal: Proposal, *, cache: kv_lib.KVCache, pending: jax.Array,
             choice: schedule_lib.Choice, widths: tuple[int, ...],
             key: jax.Array) -> finish_lib.Verified:
    """Verifies the first `choice.num_verified[b]` drafts of each row in one target forward
    of width `widths[choice.branch]`; outputs padded to 1 + the drafts' width."""
    drafts, probs = proposal.drafts.tokens, proposal.drafts.probs
    if widths[-1] - 1 > drafts.shape[1]:  # a fixed width wider than the drafts
      drafts = verify_lib.pad_axis1(drafts, widths[-1] - 1)
      probs = None if probs is None else verify_lib.pad_axis1(probs, widths[-1] - 1)
    starts = cache.lengths
    # With several widths, each branch only reads the cache (`verify.at_width`);
    # the new keys / values come out padded to the widest branch and are
    # written after the switch.
    read_only = len(widths) > 1

    def forward(width: int):
      m = width - 1
      tokens = jnp.concatenate([pending[:, None], drafts[:, :m]], axis=1)
      positions = starts[:, None] + jnp.arange(width)[None, :]
      o = self.target(tokens, positions=positions, cache=cache, taps=self.drafter.taps,
                      write_cache=not read_only)
      if self.sampling.greedy:
        acc = verify_lib.accept_greedy(logits=o.logits, drafts=drafts[:, :m],
                                       num_drafts=choice.num_verified)
      else:
        acc = verify_lib.accept_sampling(
            key=key, logits=o.logits, drafts=drafts[:, :m], draft_probs=probs[:, :m],
            num_drafts=choice.num_verified, config=self.sampling)
      padded = (acc.new_tokens, o.taps, tokens, o.new_kv if read_only else None)
      return padded, (acc.num_accepted, None if read_only else o.cache)

    (new_tokens, taps, tokens, new_kv), (k, written), width = verify_lib.at_width(
        forward, branch=choice.branch, widths=widths, pad_to=1 + drafts.shape[1])
    # Slots past the accepted tokens hold padding; the caller's lengths mask them.
    cache = cache.append(new_kv) if read_only else written
    return finish_lib.Verified(cache=cache, num_accepted=k, new_tokens=new_tokens,
                               tokens=tokens, taps=taps, width=width)
