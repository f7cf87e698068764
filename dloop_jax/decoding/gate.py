"""DLoop's confidence gate: draft another stage instead of verifying?

Two rules: a fixed threshold g on the stage's confidence (the paper's), and
`gate="auto"`, which drafts another stage when its expected tokens, by the
drafter's calibration, pay for its cost on this machine (`Gate`,
`calibrated_continue`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dloop_jax.decoding import calibration as calibration_lib


def stage_confidence(logprobs: jax.Array) -> jax.Array:
  """conf_s: sum of the drafter's log-probabilities of one stage's drafts.

  The score is per stage: it resets every stage, so a confident stage cannot
  buy credit for an uncertain one.

  Args:
    logprobs: [B, gamma] log-probabilities of the tokens drafted in this stage.

  Returns:
    [B] f32 scores.
  """
  return jnp.sum(logprobs.astype(jnp.float32), axis=-1)


# The smallest learned confidence whose log is taken (a c_k of 0 would score -inf).
MIN_CONFIDENCE = 1e-30


def learned_stage_confidence(confidence: jax.Array) -> jax.Array:
  """A stage's score from a drafter's learned confidences [B, gamma] (DSpark's head): the
  sum of their logs, in f32; what gate="auto" reads for such a drafter and what its
  calibration is measured with."""
  return stage_confidence(jnp.log(jnp.maximum(confidence.astype(jnp.float32), MIN_CONFIDENCE)))


def continue_drafting(confidence: jax.Array, *, gate: jax.Array | float,
                      stages_done: jax.Array | int, max_stages: int) -> jax.Array:
  """Whether each row drafts stage `stages_done + 1` before verifying.

  Another stage while `conf_s >= gate` and fewer than `max_stages` stages were
  drafted. With gate = -inf every row drafts `max_stages` stages; with
  gate = +inf exactly one (standard speculative decoding).

  Args:
    confidence: [B] score of the stage just drafted.
    gate: threshold g (the paper uses -0.5 or -0.75).
    stages_done: stages drafted so far, including the one just scored.
    max_stages: S_max.

  Returns:
    [B] bool.
  """
  return (confidence >= gate) & (jnp.asarray(stages_done) < max_stages)


# ----------------------------------------------------------------- gate="auto"
#
# The fixed threshold asks "is this stage confident enough?"; the right
# question depends on what another stage costs here. A drafting stage costs d
# (the drafter's stage) and widens the verification from v(s) to v(s + 1)
# (the target forward that verifies s stages' drafts; flat on an accelerator
# and at a fixed width, steep on a CPU). With the drafter's calibration
# (`decoding.calibration`: per score bin, P(stage fully accepted), E(accepted
# drafts) and E(accepted drafts of the following stage)), after stage s of a
# round with scores u_1 .. u_s:
#
#     reach_s  = prod_{i <= s} full(u_i)                 all drafts so far accepted
#     T_s      = 1 + sum_{i <= s} reach_{i-1} accepted(u_i)   expected tokens (bonus incl.)
#     C_s      = s d + v(s)                              the round's cost so far
#     gain     = reach_s next_accepted(u_s)              what stage s + 1 adds
#     draft stage s + 1   iff   gain / (d + v(s+1) - v(s))  >  T_s / C_s
#
# that is, when the tokens the stage adds, each worth the round's current
# cost per token C_s / T_s, pay for what the stage costs: the round's tokens
# per unit of time rise. Every input is a traced value (tables, costs), so a
# new table or cost does not recompile. The gate only decides what is
# proposed: lossless as every gate (docs/decoding.md).


@struct.dataclass
class Gate:
  """The gate's traced settings: a threshold g, or the calibrated rule ("auto").

  Attributes:
    threshold: scalar f32 g (the fixed rule; ignored when `auto`).
    auto: scalar bool, the calibrated rule.
    learned: scalar bool, the calibrated rule scores a stage with the
      drafter's learned confidence (its table was measured with that score).
    stage_cost: scalar f32 d, a drafting stage's cost in the cost table's unit.
    verify_cost: [S_max + 1] f32 v(s), the forward verifying s stages' drafts.
    full, accepted, next_accepted: [2, NUM_BINS] f32 the calibration
      (`calibration.Calibration`; row 0 the first stage, 1 the looped ones).
  """

  threshold: jax.Array
  auto: jax.Array
  learned: jax.Array
  stage_cost: jax.Array
  verify_cost: jax.Array
  full: jax.Array
  accepted: jax.Array
  next_accepted: jax.Array

  @classmethod
  def create(cls, *, threshold: float = 0.0, max_stages: int, table=None,
             stage_cost: float = 0.0, verify_cost=None) -> "Gate":
    """A threshold gate (`table` None) or the calibrated rule of `table`."""
    shape = (len(calibration_lib.ROWS), calibration_lib.NUM_BINS)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if verify_cost is None:
      verify_cost = [0.0] * (max_stages + 1)
    if len(verify_cost) != max_stages + 1:
      raise ValueError(f"verify_cost needs S_max + 1 = {max_stages + 1} entries, got"
                       f" {len(verify_cost)}.")
    return cls(
        threshold=f32(threshold if table is None else 0.0),
        auto=jnp.asarray(table is not None), learned=jnp.asarray(
            table is not None and table.score == "learned"),
        stage_cost=f32(stage_cost), verify_cost=f32(verify_cost),
        full=f32(table.full if table is not None else np.zeros(shape)),
        accepted=f32(table.accepted if table is not None else np.zeros(shape)),
        next_accepted=f32(table.next_accepted if table is not None else np.zeros(shape)))


@struct.dataclass
class Outlook:
  """Per row, what the stages drafted so far promise (the calibrated rule's state).

  Attributes:
    reach: [B] f32 probability that every draft so far is accepted.
    tokens: [B] f32 expected tokens the round commits (the bonus token included).
  """

  reach: jax.Array
  tokens: jax.Array

  @classmethod
  def start(cls, batch_size: int) -> "Outlook":
    ones = jnp.ones((batch_size,), jnp.float32)
    return cls(reach=ones, tokens=ones)


def calibrated_continue(gate: Gate, outlook: Outlook, *, score: jax.Array,
                        stages_done: jax.Array | int) -> tuple[jax.Array, Outlook]:
  """The calibrated rule after stage `stages_done` (>= 1) scored `score` [B].

  Returns ([B] bool draft another stage, by cost alone: S_max is the caller's;
  the outlook after this stage).
  """
  s = jnp.asarray(stages_done, jnp.int32)
  row = jnp.minimum(s - 1, 1)
  bin_ = jnp.searchsorted(jnp.asarray(calibration_lib.EDGES, jnp.float32),
                          score.astype(jnp.float32), side="right")
  full = gate.full[row, bin_]
  reach = outlook.reach * full
  tokens = outlook.tokens + outlook.reach * gate.accepted[row, bin_]
  gain = reach * gate.next_accepted[row, bin_]
  last = gate.verify_cost.shape[0] - 1
  v_now = gate.verify_cost[jnp.minimum(s, last)]
  v_next = gate.verify_cost[jnp.minimum(s + 1, last)]
  spent = s.astype(jnp.float32) * gate.stage_cost + v_now
  extra = gate.stage_cost + v_next - v_now
  more = gain * spent > extra * tokens
  return more, Outlook(reach=reach, tokens=tokens)


def decide(gate: Gate, outlook: Outlook, *, score: jax.Array, learned_score: jax.Array | None,
           stages_done: jax.Array | int, max_stages: int) -> tuple[jax.Array, Outlook]:
  """Whether each row drafts another stage: the threshold or the calibrated rule.

  Args:
    gate: the settings.
    outlook: the calibrated rule's state before this stage.
    score: [B] the stage's sum of log-probabilities (`stage_confidence`).
    learned_score: [B] its sum of log learned confidences, or None (no head).
    stages_done: stages drafted so far, this one included.
    max_stages: S_max.

  Returns:
    ([B] bool, the outlook after this stage).
  """
  auto_score = score if learned_score is None else jnp.where(gate.learned, learned_score, score)
  auto_more, outlook = calibrated_continue(gate, outlook, score=auto_score,
                                           stages_done=stages_done)
  fixed_more = continue_drafting(score, gate=gate.threshold, stages_done=stages_done,
                                 max_stages=max_stages)
  auto_more = auto_more & (jnp.asarray(stages_done) < max_stages)
  return jnp.where(gate.auto, auto_more, fixed_more), outlook
