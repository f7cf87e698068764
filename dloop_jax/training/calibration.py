"""A drafter's calibration table, measured teacher-forced on held-out answers.

    answers = calibration.answers(target, prompts, max_new_tokens=96, stop_tokens=stops)
    tables = calibration.measure(target, drafter, prompts, answers=answers,
                                 max_new_tokens=96)
    # {"probability": Calibration, "learned": Calibration (drafters with a
    #  confidence head)}

The held-out answer of a prompt is the target's own greedy answer (`generate`
in mode "ar", ending where the target stops): the tokens a greedy round would
commit there. One target forward over prompt + answer gives the tapped features
the engine would commit. The drafter then takes the prompt as after the
engine's prefill (`Drafter.commit` of every prompt position, paired with the
token after it, the answer's first at the last) and walks the answer: at each
committed length n (row-wise prompt length + t; the pending token is seq[n])
it drafts `max_stages` stages in a row (greedy), records each stage's score and
how many of its leading drafts equal the answer's tokens seq[n + 1 + s gamma
...] (-1 where the answer ends before the stage's last draft), then commits
position n with the target's features there, which drops the drafts, as a
verification's commit does. A stage s >= 2 is that of DLoop's loop: drafted
from the drafter's own earlier stages, counted only where those were fully
accepted (`decoding.calibration.from_samples`).

The walk is one jitted `lax.scan` over answer positions for a batch of rows,
compiled once per (batch size, prompt width) and shared by batches of that
shape. `stride` k > 1 drafts at every k-th position only, committing the k
positions in one commit (as the engine commits a verified round's tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.decoding import calibration as calibration_lib
from dloop_jax.decoding import gate as gate_lib
from dloop_jax.decoding import sampling as sampling_lib
from dloop_jax.errors import ConfigError



@dataclasses.dataclass(frozen=True)
class Samples:
  """The stages measured at every valid answer position.

  Attributes:
    accepted: [N, S] int leading drafts of stage s equal to the answer (-1:
      the answer ends before the stage's last draft).
    probability: [N, S] f32 sum of the stage's draft log-probabilities.
    learned: [N, S] f32 sum of the logs of its learned confidences, or None
      (no confidence head).
    row: [N] the prompt each position belongs to (index into the prompts).
    position: [N] the answer position t (committed length prompt length + t).
  """

  accepted: np.ndarray
  probability: np.ndarray
  learned: np.ndarray | None
  row: np.ndarray
  position: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Static:
  target_graph: Any
  drafter_graph: Any
  prompt_width: int
  width: int  # columns of the padded prompt + answer rows
  steps: int  # drafting positions per row
  block_size: int
  max_stages: int
  stride: int
  learned: bool


def _batches(order: Sequence[int], batch_size: int) -> list[list[int]]:
  return [list(order[i:i + batch_size]) for i in range(0, len(order), batch_size)]


def _padded(rows: list[int], batch_size: int) -> list[int]:
  """A batch's rows padded to `batch_size` with its last row (its outputs are dropped)."""
  return rows + [rows[-1]] * (batch_size - len(rows))


def answers(target: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
            stop_tokens: Sequence[int] = (), batch_size: int = 8,
            log: Callable[[str], None] | None = None) -> list[list[int]]:
  """The target's greedy answer to each prompt (`generate`, mode "ar").

  An answer ends with the first stop token (included) or after
  `max_new_tokens` tokens. Prompts are batched by length.
  """
  from dloop_jax.decoding import engine  # pylint: disable=g-import-not-at-top
  target = getattr(target, "model", target)  # a LoadedTarget
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  out: list[list[int]] = [[] for _ in prompts]
  start = time.perf_counter()
  for rows in _batches(order, batch_size):
    batch = _padded(rows, batch_size)
    result = engine.generate(target, [list(prompts[i]) for i in batch], mode="ar",
                             max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
    for i, tokens in zip(rows, result.tokens):
      out[i] = [int(t) for t in tokens]
  if log is not None:
    log(f"[calibrate] {len(prompts)} answers of {target.config.name or 'the target'}"
        f" ({sum(map(len, out))} tokens) in {time.perf_counter() - start:.1f}s")
  return out


@functools.partial(jax.jit, static_argnums=0)
def _walk(static: _Static, target_state, drafter_params, seq, prompt_lengths, lengths):
  """Per drafting step [steps, B, S]: accepted, probability score, learned score.

  Args:
    seq: [B, width] prompt + answer (zeros past `lengths`).
    prompt_lengths: [B].
    lengths: [B] prompt + answer lengths.
  """
  s = static
  target = nnx.merge(s.target_graph, target_state)
  drafter = nnx.merge(s.drafter_graph, drafter_params)
  b, width = seq.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (b, width))
  features = target(seq, positions=positions, cache=target.init_cache(batch_size=b, capacity=width),
                    taps=tuple(drafter.taps), taps_only=True).taps  # [B, width, n_taps, D]

  # The prompt, as the engine commits it after the prefill.
  tp = s.prompt_width
  state = drafter.init_state(batch_size=b, capacity=width)
  state = drafter.commit(state, tokens=seq[:, :tp], features=features[:, :tp],
                         next_tokens=seq[:, 1:tp + 1], starts=jnp.zeros((b,), jnp.int32),
                         counts=prompt_lengths)
  gamma, k = s.block_size, s.stride
  key = jax.random.key(0)  # greedy: unused
  offsets = jnp.arange(gamma, dtype=jnp.int32)[None, :]
  commit_offsets = jnp.arange(k, dtype=jnp.int32)[None, :]

  def take(x, idx):  # x [B, width, ...], idx [B, m] -> [B, m, ...]
    idx = jnp.clip(idx, 0, width - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

  def step(state, i):
    n = prompt_lengths + i * k  # committed length; the pending token is seq[n]
    drafted = state
    accepted, probability, learned = [], [], []
    for stage_index in range(s.max_stages):
      drafted, stage = drafter.draft_stage(drafted, key=key, block_size=gamma,
                                           sampling=sampling_lib.GREEDY)
      truth = take(seq, n[:, None] + 1 + stage_index * gamma + offsets)
      leading = jnp.sum(jnp.cumprod(stage.tokens == truth, axis=1), axis=1)
      valid = n + (stage_index + 1) * gamma <= lengths - 1
      accepted.append(jnp.where(valid, leading, -1).astype(jnp.int32))
      probability.append(gate_lib.stage_confidence(stage.logprobs))
      if s.learned:
        learned.append(gate_lib.learned_stage_confidence(stage.confidence))
      else:
        learned.append(jnp.zeros((b,), jnp.float32))
    # Positions n .. n + k - 1 committed (the drafts at and past n dropped).
    idx = n[:, None] + commit_offsets
    state = drafter.commit(drafted, tokens=take(seq, idx), features=take(features, idx),
                           next_tokens=take(seq, idx + 1), starts=n,
                           counts=jnp.clip(lengths - 1 - n, 0, k).astype(jnp.int32))
    return state, (jnp.stack(accepted, 1), jnp.stack(probability, 1), jnp.stack(learned, 1))

  _, out = jax.lax.scan(step, state, jnp.arange(s.steps, dtype=jnp.int32))
  return out


def stage_samples(target: Any, drafter: Any, prompts: Sequence[Sequence[int]],
                  answer_tokens: Sequence[Sequence[int]], *, block_size: int | None = None,
                  max_stages: int = 3, batch_size: int = 8, stride: int = 1,
                  log: Callable[[str], None] | None = None) -> Samples:
  """The stages a drafter drafts along the answers (module docstring).

  Args:
    target: the target `Transformer` (or `LoadedTarget`).
    drafter: a drafter for it.
    prompts: token ids per prompt.
    answer_tokens: each prompt's held-out answer (`answers`).
    block_size: gamma (None: the drafter's).
    max_stages: stages drafted in a row at each position.
    batch_size: rows per walk.
    stride: draft at every `stride`-th answer position.
    log: progress lines, one per batch.
  """
  from dloop_jax.decoding import engine  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import plan as plan_lib  # pylint: disable=g-import-not-at-top
  target = getattr(target, "model", target)
  if len(prompts) != len(answer_tokens) or not prompts:
    raise ConfigError(f"Calibration needs one answer per prompt and at least one prompt, got"
                      f" {len(prompts)} prompts and {len(answer_tokens)} answers.")
  gamma = int(block_size or drafter.block_size)
  largest = drafter.max_block_size()
  if gamma < 1 or (largest is not None and gamma > largest):
    raise ConfigError(f"block_size {gamma} is out of range for drafter {drafter.name!r}"
                      f" (1..{largest or 'any'}).")
  if max_stages < 1 or stride < 1 or batch_size < 1:
    raise ConfigError(f"max_stages, stride and batch_size must be >= 1, got {max_stages},"
                      f" {stride} and {batch_size}.")
  drafter.check_target(target.config)
  learned = bool(drafter.has_confidence)
  longest_answer = max(1, max(len(a) for a in answer_tokens))
  steps = -(-longest_answer // stride)
  target_graph, target_state = nnx.split(target)
  drafter_graph, drafter_params = nnx.split(drafter)
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  parts = {name: [] for name in ("accepted", "probability", "learned", "row", "position")}
  batches = _batches(order, batch_size)
  start = time.perf_counter()
  for number, rows in enumerate(batches):
    batch = _padded(rows, batch_size)
    tp = plan_lib.prompt_width(max(len(prompts[i]) for i in batch))
    width = tp + steps * stride + max(max_stages * gamma, stride) + 1
    seq = np.zeros((batch_size, width), np.int32)
    prompt_lengths = np.zeros((batch_size,), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for j, i in enumerate(batch):
      full = list(prompts[i]) + list(answer_tokens[i])
      seq[j, :len(full)] = full
      prompt_lengths[j], lengths[j] = len(prompts[i]), len(full)
    lengths[len(rows):] = prompt_lengths[len(rows):]  # padding rows: no answer, nothing measured
    static = _Static(target_graph=target_graph, drafter_graph=drafter_graph, prompt_width=tp,
                     width=width, steps=steps, block_size=gamma, max_stages=int(max_stages),
                     stride=int(stride), learned=learned)
    with engine.program_context(target):
      accepted, probability, learned_score = jax.device_get(_walk(
          static, target_state, drafter_params, jnp.asarray(seq), jnp.asarray(prompt_lengths),
          jnp.asarray(lengths)))
    for j, i in enumerate(rows):
      keep = np.flatnonzero(accepted[:, j, 0] >= 0)
      parts["accepted"].append(accepted[keep, j])
      parts["probability"].append(probability[keep, j])
      parts["learned"].append(learned_score[keep, j])
      parts["row"].append(np.full(len(keep), i))
      parts["position"].append(keep * stride)
    if log is not None:
      done = sum(len(x) for x in parts["row"])
      log(f"[calibrate] {drafter.name}: batch {number + 1}/{len(batches)}, {done} positions,"
          f" {time.perf_counter() - start:.1f}s")
  cat = {name: np.concatenate(values) for name, values in parts.items()}
  s = int(max_stages)
  return Samples(accepted=cat["accepted"].reshape(-1, s).astype(np.int64),
                 probability=cat["probability"].reshape(-1, s),
                 learned=cat["learned"].reshape(-1, s) if learned else None,
                 row=cat["row"].astype(np.int64), position=cat["position"].astype(np.int64))


def measure(target: Any, drafter: Any, prompts: Sequence[Sequence[int]], *,
            max_new_tokens: int, answer_tokens: Sequence[Sequence[int]] | None = None,
            stop_tokens: Sequence[int] = (), block_size: int | None = None,
            max_stages: int = 3, batch_size: int = 8, stride: int = 1,
            scores: Sequence[str] | None = None, label: str | None = None,
            log: Callable[[str], None] | None = None) -> dict[str, calibration_lib.Calibration]:
  """`drafter`'s calibration tables, measured on the target's answers to `prompts`.

  Args:
    target: the target `Transformer` (or `LoadedTarget`).
    drafter: a drafter for it.
    prompts: held-out prompts (token ids; chat template applied).
    max_new_tokens: answer length limit.
    answer_tokens: the target's answers (`answers`) when already computed (several
      drafters of one target); None: generated here.
    stop_tokens: tokens that end an answer.
    block_size: gamma (None: the drafter's).
    max_stages: stages drafted in a row at each position (the table's looped
      row is measured from stage 2 on).
    batch_size: rows per program.
    stride: draft at every `stride`-th answer position.
    scores: which tables: "probability" and / or "learned" (None: both where
      the drafter has a confidence head, else "probability").
    label: the drafter's name in the tables' source (None: `drafter.name`).
    log: progress lines.

  Returns:
    {score: Calibration}.
  """
  target = getattr(target, "model", target)
  if scores is None:
    scores = ("probability", "learned") if drafter.has_confidence else ("probability",)
  for score in scores:
    if score not in calibration_lib.SCORES:
      raise ConfigError(f"Unknown calibration score {score!r}; expected one of"
                        f" {calibration_lib.SCORES}.")
    if score == "learned" and not drafter.has_confidence:
      raise ConfigError(f"Drafter {drafter.name!r} has no confidence head: no 'learned' score.")
  if answer_tokens is None:
    answer_tokens = answers(target, prompts, max_new_tokens=max_new_tokens,
                            stop_tokens=stop_tokens, batch_size=batch_size, log=log)
  samples = stage_samples(target, drafter, prompts, answer_tokens, block_size=block_size,
                          max_stages=max_stages, batch_size=batch_size, stride=stride, log=log)
  gamma = int(block_size or drafter.block_size)
  source = (f"{label or drafter.name} on {target.config.name or 'the target'}: {len(prompts)}"
            f" prompts, {len(samples.row)} positions"
            + (f" (stride {stride})" if stride > 1 else "")
            + f", greedy answers of up to {max_new_tokens} tokens, {max_stages} stages")
  tables = {}
  for score in scores:
    values = samples.probability if score == "probability" else samples.learned
    tables[score] = calibration_lib.from_samples(
        scores=values, accepted=samples.accepted, block_size=gamma, score=score, source=source)
  return tables
