"""What to verify: the prefix of the drafts whose verification pays.

After drafting (the gate decides how many stages), a round may verify any
prefix of its drafts: j = 0 is a plain decode step (the target reads only the
pending token and commits its own next token). With c_k the probability that
draft k is accepted given that drafts 1..k-1 were, the expected number of
tokens a round commits when it verifies j drafts is

    E(j) = 1 + sum_{i <= j} prod_{k <= i} c_k        (the 1 is the bonus token)

and it costs one target forward of width 1 + j. The scheduler maximises
committed tokens per unit of target time, E(j) / cost(1 + j).

Widths are compiled `lax.switch` branches (`verify_widths`); a j between two
widths pays for the wider one, so each branch verifies as many drafts as it
holds: row r verifies min(n_r, w - 1) of its n_r drafts in a branch of width w.
The choice is therefore one of the widths.

Batch > 1: one forward serves every row, so the choice is made once per round
for the whole batch, maximising the batch's expected tokens per unit of time,
sum over active rows of E_r(min(n_r, w - 1)), divided by cost(w) (the cost
table is measured at the batch size). Rows never verify more than they drafted,
and widths wider than every active row's drafts are never chosen.

Two rules (`choose`):

  * greedy decoding (`causal=False`): the exact argmax over the widths. Any
    choice is lossless: greedy acceptance reproduces the target's argmax chain
    whatever prefix is verified.
  * sampling (`causal=True`): rejection sampling is exact for draft k only if
    the decision to verify it does not depend on draft k itself (given the
    drafts before it). Verifying draft k only when it looks likely skews the
    accepted tokens towards the drafter's favourites. So depth k is admitted
    from c_1..c_k alone, where c_k must be a function of the drafts *before*
    k (see `draft_confidence`), and admission stops at the first depth that is
    not worth it (DSpark's early stop): admit depth k while the best ratio
    reachable from k, assuming the later drafts are as confident as draft k,
    beats stopping at k - 1. Rounding up to the compiled width afterwards is
    still causal (the width depends only on decisions about earlier depths).

Where c_k comes from (`CONFIDENCES`, `generate(confidence=...)`): the
drafter's probabilities (`draft_confidence`), or a learned confidence the
drafter returns with its drafts (`DraftStage.confidence`, DSpark's confidence
head). A learned c_k satisfies the sampling rule's condition when it is a
function of the drafter's state and the drafts before k, not of draft k:
DSpark's head reads the backbone's hidden state at k (computed from the
context and the stage's anchor, before any draft of the stage is drawn) and
the token before k.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import sampling as sampling_lib

SCHEDULES = ("cost", "off")
# Where the scheduler's c_k come from. "auto": the drafter's learned confidence
# when it has one (`Drafter.has_confidence`), else its probabilities.
CONFIDENCES = ("auto", "drafter", "probability")

# Widths below one stage that get their own branch: the cost per token is
# steepest there (on a CPU a 2-token forward costs ~1.35x a 1-token one).
SMALL_WIDTHS = (1, 2, 3)


def verify_widths(*, block_size: int, max_stages: int, schedule: str) -> tuple[int, ...]:
  """The compiled verification widths of chains (static), in increasing order.

  "off" verifies every draft: one width per stage count, 1 + s * gamma.
  "cost" adds `SMALL_WIDTHS` (1 is the plain decode step); a prefix between
  two widths is verified in the wider branch. For gamma = 4, S_max = 3:
  off (5, 9, 13), cost (1, 2, 3, 5, 9, 13).
  """
  return widths_for_drafts([s * block_size for s in range(1, max_stages + 1)],
                           schedule=schedule)


def widths_for_drafts(stage_drafts: Sequence[int], *, schedule: str) -> tuple[int, ...]:
  """Widths 1 + n for the most drafts n after each stage count (chains or trees),
  with `SMALL_WIDTHS` up to the widest for "cost"; increasing."""
  widths = {1 + n for n in stage_drafts}
  if schedule != "off":
    widths |= {w for w in SMALL_WIDTHS if w <= max(widths)}
  return tuple(sorted(widths))


def choosable_widths(widths: Sequence[int], costs: Sequence[float], *,
                     tolerance: float) -> tuple[int, ...]:
  """The widths worth compiling under a cost table: `widths` less those a wider one
  nearly matches in cost.

  The scheduler picks the width of the best expected tokens per cost, and
  the expected tokens of a width never fall as it widens. So dropping a
  width w whose next kept wider width costs at most (1 + tolerance) x
  cost(w) loses at most that fraction of the best ratio, in every round.
  Width 1 (the plain step) and the widest stay. A flat table (accelerators:
  one to a few dozen tokens cost about the same) keeps few widths; a steep
  one (CPUs) keeps them all. For example, with widths (1, 2, 3, 5, 9, 13),
  costs (1.0, 1.003, 1.006, 1.013, 1.025, 1.038) and tolerance 0.02:

      13 kept (widest)   9: 1.038 <= 1.02 x 1.025, dropped
      5: 1.038 > 1.02 x 1.013, kept   3, 2: within 2 % of 5's, dropped
      -> (1, 5, 13)

  Args:
    widths: the compiled candidates, increasing, widths[0] = 1.
    costs: a forward's cost at each of them.
    tolerance: >= 0; 0 keeps every width.
  """
  if tolerance < 0:
    raise ValueError(f"tolerance must be >= 0, got {tolerance}.")
  if tolerance == 0:
    return tuple(widths)
  kept = [widths[-1]]
  next_cost = costs[-1]
  for w, c in zip(reversed(widths[:-1]), reversed(costs[:-1])):
    if w == 1 or next_cost > (1.0 + tolerance) * c:
      kept.append(w)
      next_cost = c
  return tuple(reversed(kept))


def draft_confidence(*, logprobs: jax.Array, probs: jax.Array | None,
                     config: sampling_lib.SamplingConfig) -> jax.Array:
  """c_k of one stage's drafts: the drafter's estimate that draft k is accepted.

  The probability-based c_k; a drafter's learned confidence
  (`DraftStage.confidence`) replaces it when the engine is told to use it.

  Greedy: exp of the drafted token's log-probability (the drafted token is the
  drafter's argmax, so this is its top probability).
  Sampling: the largest probability of the processed draft distribution at k,
  not the probability of the token drawn there: the latter depends on draft k,
  and a verification decided by it would bias rejection sampling (module
  docstring).

  Args:
    logprobs: [B, gamma] drafter log-probabilities of the drafted tokens.
    probs: [B, gamma, V] processed draft distributions (sampling only).
    config: the sampling configuration.

  Returns:
    [B, gamma] f32 in [0, 1].
  """
  if config.greedy or probs is None:
    return jnp.exp(logprobs.astype(jnp.float32))
  return jnp.max(probs.astype(jnp.float32), axis=-1)


def expected_committed(confidence: jax.Array) -> jax.Array:
  """E(j) for j = 0..m: 1 + sum_{i <= j} prod_{k <= i} c_k.

  Args:
    confidence: [B, m] c_k per row.

  Returns:
    [B, m + 1] f32, nondecreasing in j; E(0) = 1.
  """
  c = jnp.clip(confidence.astype(jnp.float32), 0.0, 1.0)
  survive = jnp.cumprod(c, axis=-1)
  ones = jnp.ones(c.shape[:-1] + (1,), jnp.float32)
  return jnp.concatenate([ones, 1.0 + jnp.cumsum(survive, axis=-1)], axis=-1)


@struct.dataclass
class Choice:
  """What a round verifies.

  Attributes:
    branch: scalar int32, index into the compiled widths.
    num_verified: [B] int32 drafts each row verifies (0 for inactive rows).
  """

  branch: jax.Array
  num_verified: jax.Array


def _round_up(widths: tuple[int, ...], m: int) -> tuple[list[int], list[int]]:
  """Per j = 0..m: the index of the narrowest width >= 1 + j, and that width."""
  index = [next(i for i, w in enumerate(widths) if w >= 1 + j) for j in range(m + 1)]
  return index, [widths[i] for i in index]


def choose(*, confidence: jax.Array, num_drafts: jax.Array, active: jax.Array,
           widths: tuple[int, ...], costs: jax.Array, causal: bool) -> Choice:
  """Picks the verification width of a round (module docstring).

  Args:
    confidence: [B, m] c_k of every drafted position (m = the static draft
      width; entries past a row's `num_drafts` are ignored).
    num_drafts: [B] drafts each row drafted this round.
    active: [B] bool, rows still generating (the others do not count).
    widths: the compiled widths (static, increasing, widths[0] = 1, the last
      >= 1 + m).
    costs: [len(widths)] positive cost of a target forward at each width (any
      unit, a traced array: new tables do not recompile).
    causal: the sampling rule (admit depth by depth) instead of the argmax.

  Returns:
    A `Choice`. Ties go to the narrower width.
  """
  b, m = confidence.shape
  assert widths[0] == 1 and widths[-1] >= 1 + m, (widths, m)
  costs = costs.astype(jnp.float32)
  n = jnp.where(active, jnp.minimum(num_drafts, m), 0)
  valid = jnp.arange(m)[None, :] < n[:, None]
  c = jnp.where(valid, jnp.clip(confidence.astype(jnp.float32), 0.0, 1.0), 0.0)
  expected = expected_committed(c)  # [B, m + 1]; flat past n_r since c = 0 there
  weight = active.astype(jnp.float32)[:, None]
  widest_needed = 1 + jnp.max(n)
  index, rounded = _round_up(widths, m)

  if not causal:
    w = jnp.asarray(widths)
    verify = jnp.minimum(w - 1, m)  # [W] drafts a width holds
    tokens = jnp.sum(weight * expected[:, verify], axis=0)  # [W]
    # A width is useful if the next narrower one does not already hold every draft.
    narrower = jnp.concatenate([jnp.zeros((1,), w.dtype), w[:-1]])
    useful = narrower < widest_needed
    ratio = jnp.where(useful, tokens / costs, -jnp.inf)
    branch = jnp.argmax(ratio).astype(jnp.int32)  # first maximum: the narrower width
  else:
    cost_j = costs[jnp.asarray(index)]  # [m + 1] cost of verifying j drafts
    ratio = jnp.sum(weight * expected, axis=0) / cost_j  # R(j), j = 0..m
    # Lookahead from depth i (1..m): extend every row that has draft i with
    # its c_i, E_r(j) ~ E_r(i) + P_r(i) * sum_{t=1}^{j-i} c_i^t. Not capped at
    # the row's drafts: how many stages were drafted after the one holding
    # draft i depends on draft i (the gate scores it), so only c_1..c_i and
    # whether draft i exists may be used. Rows without draft i have c_i = 0.
    i = jnp.arange(1, m + 1)[:, None]  # [m, 1]
    j = jnp.arange(m + 1)[None, :]  # [1, m + 1]
    survive = expected[:, 1:] - expected[:, :-1]  # [B, m] P_r(i) = prod_{k<=i} c_k
    c_i = c.T[:, :, None]  # [m, B, 1]
    steps = jnp.broadcast_to(jnp.clip(j - i, 0, None)[:, None, :], (m, b, m + 1))
    geometric = jnp.where(c_i < 1.0, c_i * (1.0 - c_i ** steps) / jnp.where(c_i < 1.0, 1.0 - c_i,
                                                                          1.0), steps)
    guess = expected.T[1:, :, None] + survive.T[:, :, None] * geometric  # [m, B, m + 1]
    reach = jnp.sum(weight.T[:, :, None] * guess, axis=1) / cost_j[None, :]  # [m, m + 1]
    ahead = jnp.max(jnp.where(j >= i, reach, -jnp.inf), axis=1)  # [m] best from depth i on
    admit = (ahead > ratio[:-1]) & (jnp.arange(1, m + 1) <= jnp.max(n))
    depth = jnp.sum(jnp.cumprod(admit.astype(jnp.int32)))  # leading admitted depths
    branch = jnp.asarray(index, jnp.int32)[depth]
  verify = jnp.asarray(widths, jnp.int32)[branch] - 1
  return Choice(branch=branch, num_verified=jnp.minimum(n, verify).astype(jnp.int32))


def verify_all(*, num_drafts: jax.Array, active: jax.Array, widths: tuple[int, ...]) -> Choice:
  """schedule="off": every draft is verified, in the narrowest width that holds them all."""
  n = jnp.where(active, num_drafts, 0).astype(jnp.int32)
  holds = jnp.asarray(widths, jnp.int32) >= 1 + jnp.max(n)
  return Choice(branch=jnp.argmax(holds).astype(jnp.int32), num_verified=n)
