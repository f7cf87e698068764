"""What a speculative round proposes for verification, and the proposers' interface.

A round (`decode_loop.DecodeLoop.speculative_round`) is the same for chains
and trees:

    propose   the proposer drafts, stage after gated stage  -> `Proposal`
    choose    the scheduler picks how many drafts each row verifies
              (`schedule.choose` on `Proposal.confidence`, or all)
    verify    the proposer's one target forward and acceptance  -> `finish.Verified`
    commit    the loop commits the accepted tokens (`decode_loop`)

Two proposers implement it: `chain_round.ChainProposer` (gated chains, with
the prompt lookup's drafts in place of a row's first stage where its rule
fires) and `tree_round.TreeProposer` (a draft tree per stage).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import struct

from dloop_jax.decoding import finish as finish_lib
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.models import kv_cache as kv_lib


@struct.dataclass
class Proposal:
  """One round's drafts, per row.

  Attributes:
    drafts: the proposer's own form (`chain_round.Chain`, `tree_round.Drafted`).
    confidence: [B, N] c_k, the scheduler's probability that draft k is
      accepted given the earlier ones are (N: the most drafts a round holds).
    num_drafts: [B] drafts (chains) or tree nodes proposed.
    num_stages: [B] drafting stages run.
    looked_up: [B] bool, rows whose drafts came from the prompt lookup.
  """

  drafts: Any
  confidence: jax.Array
  num_drafts: jax.Array
  num_stages: jax.Array
  looked_up: jax.Array


class Proposer(Protocol):
  """Drafts a round and verifies it (see the module docstring)."""

  @property
  def causal(self) -> bool:
    """Whether the scheduler must admit drafts depth by depth (`schedule.choose`)."""

  def propose(self, drafter_state: Any, *, going: jax.Array, key: jax.Array,
              lookup: lookup_lib.Proposal | None) -> tuple[Any, Proposal]:
    """(the drafter's state after drafting, the proposal); `going` [B]: rows that draft."""

  def verify(self, proposal: Proposal, *, cache: kv_lib.KVCache, pending: jax.Array,
             choice: schedule_lib.Choice, widths: tuple[int, ...],
             key: jax.Array) -> finish_lib.Verified:
    """One target forward over [pending, the chosen drafts] and its acceptance."""
