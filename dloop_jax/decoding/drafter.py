"""The drafter protocol: what the decoding engine asks of a drafter.

The engine's contract, so it lives with the engine; the drafters
(`dloop_jax.drafters`) implement it.

A drafter is an `nnx.Module` used functionally: the engine splits it into
`(graphdef, state)` outside `jax.jit` and merges it inside. Everything that
changes during decoding (its KV cache, pending hidden states) lives in an
explicit pytree, the *drafter state*, passed in and returned.

The engine talks to a drafter in two calls:

  * `commit`: after the prompt prefill and after every verification, the
    target's tapped hidden states for the newly committed positions, paired
    with the token that follows each position. The drafter first discards
    anything it holds at or past `starts` (its own unverified drafts of the
    previous round), then ingests the `counts[b]` valid pairs.

        position     n    n+1   ...  n+k
        tokens       x_n  d_1   ...  d_k        (what the target read)
        features     f_n  f_n+1 ...  f_n+k      (target taps there)
        next_tokens  d_1  d_2   ...  bonus      (committed after each)

  * `draft_stage`: one drafting stage of `block_size` tokens, continuing after
    everything committed and after the drafter's own earlier stages of this
    round. At unverified positions there are no target features; the drafter
    conditions on its own hidden states there (DLoop's looped stages).

Autoregressive drafters (EAGLE-3) draft a stage as `block_size` sequential
steps; parallel drafters (block / DFlash-style) in one forward.

Drafter forwards (the `drafter_forwards` statistic). One drafter forward is
one pass of the drafter's network over the positions it reads together: a
`commit` (all newly committed positions at once; the block drafter's context
projection), one sequential step of an autoregressive drafter, or a parallel
drafter's whole block. Taking a token from logits of a hidden state already
computed (the LM head on the output of the previous pass) is not a forward.
Per round: `drafting_forwards(gamma, s)` for the s stages drafted, plus 1 for
the commit after verification when some row accepted a draft; plus 1 for the
commit after the prefill. Tokens committed without an accepted draft (a
round's bonus token alone, the rounds of a drafting pause) are read by the
next drafting round in one more forward (`decoding.deferred`). Counts
are per row: a row is charged the stages it drafted, although the batched
program keeps drafting for every row while any row continues.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from dloop_jax.decoding.sampling import SamplingConfig
from dloop_jax.errors import DrafterMismatchError
from dloop_jax.models.config import TransformerConfig

DrafterState = Any  # a pytree of arrays


@struct.dataclass
class DraftStage:
  """One stage of drafts.

  Attributes:
    tokens: [B, gamma] int32 drafted tokens (target vocabulary ids).
    logprobs: [B, gamma] f32 drafter log-probabilities of those tokens under
      its unprocessed (temperature 1) distribution: the gate's score.
    probs: [B, gamma, V] f32 processed draft distribution over the target
      vocabulary the tokens were sampled from (sampling only, else None).
    confidence: [B, gamma] f32 in (0, 1): the drafter's own estimate that each
      draft is accepted given the earlier ones are (a learned confidence head,
      DSpark), usable as the scheduler's c_k; None for drafters without one.
  """

  tokens: jax.Array
  logprobs: jax.Array
  probs: jax.Array | None = None
  confidence: jax.Array | None = None


@struct.dataclass
class TreeStage:
  """One stage of a draft tree: per-position distributions, or scored prefixes.

  A parallel drafter gives `logprobs` (the engine takes the top prefixes,
  `decoding.tree.beam`); a drafter whose distributions depend on the path
  (EAGLE-3's dynamic tree) scores the prefixes itself: `candidates`.

  Attributes:
    logprobs: [B, gamma, Vd] f32 log-softmax of the drafter's unprocessed
      (temperature 1) logits at each of the gamma positions, or None.
    vocab: [Vd] int32 target id of each column, or None when the columns are
      target ids (Vd = V).
    candidates: a `decoding.tree.Candidates` beam (tokens are target ids), or
      None.
  """

  logprobs: jax.Array | None = None
  vocab: jax.Array | None = None
  candidates: Any = None


class Drafter(nnx.Module):
  """Base class of drafters.

  Subclasses set, in `__init__`:
    kind: "autoregressive" or "parallel".
    taps: target decoder layers whose outputs the drafter consumes.
    block_size: the stage size gamma it was built / trained for.
    target_fingerprint: `tuple(sorted(TransformerConfig.fingerprint.items()))`
      of its target (a tuple: static module attributes must be hashable).
    name: human-readable name.
  """

  kind: str
  taps: tuple[int, ...]
  block_size: int
  target_fingerprint: tuple
  name: str = "drafter"

  def forwards_per_stage(self, block_size: int, *, first: bool) -> int:
    """Drafter forwards one stage of `block_size` drafts costs (statistics).

    Args:
      block_size: gamma.
      first: whether the stage is the first of its round (it follows a commit).
    """
    del first
    return block_size if self.kind == "autoregressive" else 1

  def drafting_forwards(self, block_size: int, num_stages: jax.Array) -> jax.Array:
    """Drafter forwards of the `num_stages` [B] stages of one round (commit excluded)."""
    first = self.forwards_per_stage(block_size, first=True)
    later = self.forwards_per_stage(block_size, first=False)
    return jnp.where(num_stages > 0, first + (num_stages - 1) * later, 0).astype(jnp.int32)

  def max_block_size(self) -> int | None:
    """Largest stage size it can draft (None = any)."""
    return None if self.kind == "autoregressive" else self.block_size

  def check_target(self, config: TransformerConfig) -> None:
    """Raises DrafterMismatchError unless this drafter was built for `config`."""
    mine = dict(self.target_fingerprint)
    theirs = config.fingerprint
    diffs = [f"{k}: drafter expects {mine[k]!r}, target has {theirs.get(k)!r}"
             for k in mine if k in theirs and mine[k] != theirs[k]]
    bad_taps = [t for t in self.taps if not 0 <= t < config.num_layers]
    if bad_taps:
      diffs.append(f"tapped layers {bad_taps} do not exist in a {config.num_layers}-layer target")
    if diffs:
      raise DrafterMismatchError(
          f"Drafter {self.name!r} was built for another target"
          f" ({config.name or 'this one'}): " + "; ".join(diffs)
          + ". Use a drafter trained for this target.")

  def init_state(self, *, batch_size: int, capacity: int) -> DrafterState:
    """Empty drafter state for `batch_size` rows and `capacity` positions."""
    raise NotImplementedError

  def commit(self, state: DrafterState, *, tokens: jax.Array, features: jax.Array,
             next_tokens: jax.Array, starts: jax.Array, counts: jax.Array) -> DrafterState:
    """Ingests target features of newly committed positions.

    Args:
      state: drafter state.
      tokens: [B, W] tokens at positions `starts[b] + t`.
      features: [B, W, n_taps, D] target taps at those positions.
      next_tokens: [B, W] the committed token following each position.
      starts: [B] first position; the drafter drops what it holds at or after it.
      counts: [B] valid entries per row (0 = row unchanged, e.g. finished).
    """
    raise NotImplementedError

  # Whether `draft_tree_stage` is implemented (tree verification, `tree_budget`).
  supports_trees: bool = False

  @property
  def has_confidence(self) -> bool:
    """Whether `draft_stage` returns a learned `DraftStage.confidence` (the scheduler's c_k)."""
    return False

  def draft_tree_stage(self, state: DrafterState, *, block_size: int,
                       budget: int) -> tuple[DrafterState, TreeStage]:
    """The next `block_size` positions of a draft tree of `budget` nodes.

    The state continues along the stage's best path (the argmax token at every
    position for per-position distributions; the best-scoring full-depth
    prefix of `candidates`), exactly as after drafting that path as a chain:
    a following stage drafts from that path's end.
    """
    raise NotImplementedError

  def draft_stage(self, state: DrafterState, *, key: jax.Array, block_size: int,
                  sampling: SamplingConfig) -> tuple[DrafterState, DraftStage]:
    """Drafts the next `block_size` tokens after everything it holds."""
    raise NotImplementedError
