"""Data-scaling curves: engine τ of drafter runs against the examples they trained on.

A run is a `python -m train` workdir: its `metrics.jsonl` holds the engine τ the
trainer measured every `eval.every_steps` (`engine_tau_sd`), its checkpoints'
metadata the config it ran (`data.max_examples`, `data.path`, the drafter's γ).

The fit treats a stage as γ drafts each accepted with one probability α, the
acceptance length of a round then being

    τ(α) = 1 + α + α² + ... + α^γ = (1 − α^(γ+1)) / (1 − α),

and fits logit(α) linear in log10(examples). Unlike a straight line through τ,
this keeps every prediction inside (1, γ + 1), and it is the form in which a
drafter's per-draft accuracy grows with data when the gains slow near
saturation. An extrapolation from it is a model's guess, not a measurement:
`predict` and `examples_for_tau` say so in their names, and the command prints
them as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

from dloop_jax.errors import ConfigError
from dloop_jax.training import checkpointing
from dloop_jax.training.metrics_writer import METRICS_FILE
from dloop_jax.training.trainer import CHECKPOINT_DIR

TAU_KEY = "engine_tau_sd"


@dataclasses.dataclass(frozen=True)
class RunCurve:
  """One run's engine τ over its training.

  Attributes:
    workdir: the run's directory.
    examples: training examples it drew from (`data.max_examples`, or the
      dataset's whole split when that is 0).
    gamma: drafts per stage of its drafter (τ is at most γ + 1).
    steps: [E] training steps at which τ was measured.
    taus: [E] the engine τ (`sd`, every draft verified) at those steps.
    last_step: the newest logged training step.
    num_steps: the steps the run was configured for (it may stop earlier:
      `eval.patience`).
    patience: its `eval.patience` (0: none): it stops after this many
      evaluations without a better τ.
  """

  workdir: str
  examples: int
  gamma: int
  steps: tuple[int, ...]
  taus: tuple[float, ...]
  last_step: int
  num_steps: int
  patience: int = 0

  @property
  def best_index(self) -> int:
    # The first of equal values: the trainer keeps the first best step.
    return int(np.argmax(self.taus))

  @property
  def best_step(self) -> int:
    return self.steps[self.best_index]

  @property
  def best_tau(self) -> float:
    return self.taus[self.best_index]

  @property
  def converged(self) -> bool:
    """Whether τ stopped rising before the run ended: its best is not its last evaluation."""
    return self.best_index < len(self.taus) - 1

  @property
  def finished(self) -> bool:
    """Whether the run ended: it trained all its steps, or `eval.patience` stopped it."""
    evals_since_best = len(self.taus) - 1 - self.best_index
    return (self.last_step >= self.num_steps
            or bool(self.patience) and evals_since_best >= self.patience)

  @property
  def lower_bound(self) -> bool:
    """Whether its best τ may still rise: τ was rising at its last evaluation, or the run
    stopped before its steps and its patience ran out."""
    return not self.converged or not self.finished

  def status(self) -> str:
    if not self.converged:
      return "still rising"
    if not self.finished:
      return f"stopped at step {self.last_step:,} of {self.num_steps:,}"
    return "converged"

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> "RunCurve":
    """The inverse of `to_json`: a curve archived by `python -m train.scaling --json`."""
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in record]
    if missing:
      raise ConfigError(f"An archived run lacks {missing}: pass a file that"
                        " `python -m train.scaling --json` wrote.")
    values = {n: record[n] for n in names if n in record}
    values["steps"] = tuple(int(x) for x in values["steps"])
    values["taus"] = tuple(float(x) for x in values["taus"])
    if not values["steps"] or len(values["steps"]) != len(values["taus"]):
      raise ConfigError(f"The archived run {record.get('workdir')!r} has"
                        f" {len(values['steps'])} steps and {len(values['taus'])} τ values.")
    return cls(**values)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    raise ConfigError(f"{workdir} holds no {METRICS_FILE}: pass the workdir of a"
                      " `python -m train` run.")
  with open(path) as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  rows = []
  for i, (n, line) in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        continue  # a run killed mid-write leaves a partial last line
      raise ConfigError(f"{path}, line {n}, is not JSON: the file is damaged.") from None
  return rows


def run_config(workdir: str) -> dict[str, Any]:
  """The metadata of the run's newest checkpoint (`config`, `drafter_config`, ...)."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not checkpointing.has_checkpoints(directory):
    raise ConfigError(f"{workdir} has no checkpoints to read its config from; pass its"
                      " examples explicitly (--examples).")
  # The run may be training now: read without touching its save in flight.
  ckpt = checkpointing.Checkpointer(directory, async_save=False, read_only=True)
  try:
    return ckpt.read_meta(ckpt.latest_step())
  finally:
    ckpt.close()


def dataset_size(path: str) -> int:
  """Examples in the training split of a dataset built by `python -m train.data`."""
  from dloop_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  return len(pipeline.data_source(path))


def read_run(workdir: str, *, examples: int | None = None) -> RunCurve:
  """A run's curve; `examples` overrides what its config says."""
  rows = read_metrics(workdir)
  evals = [(int(r["step"]), float(r[TAU_KEY])) for r in rows if TAU_KEY in r]
  if not evals:
    raise ConfigError(f"{workdir}/{METRICS_FILE} holds no {TAU_KEY}: the run measured no engine"
                      " τ (set --config.eval.every_steps).")
  meta = run_config(workdir)
  config = meta.get("config", {})
  if examples is None:
    data = config.get("data", {})
    examples = int(data.get("max_examples") or 0) or dataset_size(data["path"])
  gamma = int(meta.get("drafter_config", {}).get("block_size")
              or config.get("drafter", {}).get("block_size") or 0)
  if gamma < 1:
    raise ConfigError(f"{workdir}: its checkpoint names no drafter block size.")
  steps = [int(r["step"]) for r in rows if "step" in r]
  return RunCurve(workdir=workdir, examples=int(examples), gamma=gamma,
                  steps=tuple(s for s, _ in evals), taus=tuple(t for _, t in evals),
                  last_step=max(steps), num_steps=int(config.get("num_steps", max(steps))),
                  patience=int(config.get("eval", {}).get("patience") or 0))


# ------------------------------------------------------------- acceptance model
def tau_of_alpha(alpha: np.ndarray | float, gamma: int) -> np.ndarray:
  """τ = 1 + α + ... + α^γ: a stage of γ drafts, each accepted with probability α."""
  alpha = np.asarray(alpha, np.float64)
  return sum(alpha ** k for k in range(gamma + 1))


def alpha_of_tau(tau: float, gamma: int) -> float:
  """The α with τ(α) = tau (bisection: τ rises with α on [0, 1])."""
  if not 1.0 < tau < gamma + 1:
    raise ConfigError(f"τ {tau} is outside (1, {gamma + 1}): no acceptance rate gives it.")
  lo, hi = 0.0, 1.0
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if tau_of_alpha(mid, gamma) < tau else (lo, mid)
  return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class ScalingFit:
  """logit(α) = intercept + slope · log10(examples), for drafters of γ drafts a stage."""

  intercept: float
  slope: float
  gamma: int

  def predict(self, examples: float | np.ndarray) -> np.ndarray:
    """Extrapolated τ at `examples` (a model's guess beyond the measured points)."""
    z = self.intercept + self.slope * np.log10(np.asarray(examples, np.float64))
    return tau_of_alpha(1.0 / (1.0 + np.exp(-z)), self.gamma)

  def examples_for_tau(self, tau: float) -> float:
    """Examples at which the fit reaches `tau` (inf when the fit does not rise)."""
    alpha = alpha_of_tau(tau, self.gamma)
    if self.slope <= 0:
      return math.inf
    return 10.0 ** ((math.log(alpha / (1 - alpha)) - self.intercept) / self.slope)


def fit(points: Iterable[tuple[int, float]], *, gamma: int) -> ScalingFit:
  """Least squares of logit(α(τ)) on log10(examples) over (examples, τ) points."""
  points = list(points)
  if len({n for n, _ in points}) < 2:
    raise ConfigError("A scaling fit needs runs on at least two data sizes.")
  x = np.log10([n for n, _ in points])
  alphas = np.array([alpha_of_tau(t, gamma) for _, t in points])
  slope, intercept = np.polyfit(x, np.log(alphas / (1 - alphas)), 1)
  return ScalingFit(intercept=float(intercept), slope=float(slope), gamma=gamma)


# ------------------------------------------------------------------ reporting
def table(curves: Sequence[RunCurve], held_out: Sequence[float] | None = None) -> str:
  """Markdown: one row per run; `held_out`: each run's held-out τ, in the order of `curves`."""
  held_out = list(held_out) if held_out is not None else [None] * len(curves)
  head = ("| examples | run | best step (of the last logged) | engine τ at the best step |"
          " status | τ, held-out evaluation |")
  lines = [head, "|---|---|---|---|---|---|"]
  for c, extra in sorted(zip(curves, held_out), key=lambda pair: pair[0].examples):
    lines.append(f"| {c.examples:,} | {os.path.basename(os.path.normpath(c.workdir))} |"
                 f" {c.best_step:,} ({c.last_step:,}) | {c.best_tau:.3f} |"
                 f" {c.status()} |"
                 f" {'' if extra is None else f'{extra:.3f}'} |")
  return "\n".join(lines)


def steps_table(curves: Sequence[RunCurve]) -> str:
  """Markdown: engine τ of each run (rows) at every evaluated step (blank: not reached)."""
  steps = sorted({s for c in curves for s in c.steps})
  lines = ["| examples | " + " | ".join(f"{s:,}" for s in steps) + " |",
           "|---|" + "---|" * len(steps)]
  for c in sorted(curves, key=lambda c: c.examples):
    by_step = dict(zip(c.steps, c.taus))
    lines.append(f"| {c.examples:,} | "
                 + " | ".join(f"{by_step[s]:.3f}" if s in by_step else "" for s in steps) + " |")
  return "\n".join(lines)


def plot(curves: Sequence[RunCurve], points: Sequence[tuple[int, float]], scaling: ScalingFit,
         *, extrapolate_to: int, out: str, point_label: str) -> None:
  """Two panels: τ over training steps per run; τ against examples with the fit.

  `points` are the runs' (examples, τ), in the order of `curves`.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for c in sorted(curves, key=lambda c: c.examples):
    left.plot(c.steps, c.taus, marker="o", ms=3, label=f"{c.examples:,} examples")
    left.plot([c.best_step], [c.best_tau], marker="*", ms=11, color="black")
  left.set_xlabel("training step")
  left.set_ylabel("engine τ (sd, γ = %d)" % scaling.gamma)
  left.set_title("engine τ during training (★ best step)")
  left.grid(alpha=0.3)
  left.legend()

  xs = np.array([n for n, _ in points])
  rising = np.array([c.lower_bound for c in curves])
  taus = np.array([t for _, t in points])
  right.plot(xs[~rising], taus[~rising], "o", color="C0", label=point_label)
  if rising.any():
    right.plot(xs[rising], taus[rising], "o", mfc="none", color="C0",
               label=point_label + ", may still rise (lower bound)")
  lo, hi = xs.min(), max(xs.max(), extrapolate_to)
  grid = np.logspace(np.log10(lo), np.log10(xs.max()), 50)
  right.plot(grid, scaling.predict(grid), "-", color="C1", label="fit: logit α linear in log N")
  if extrapolate_to > xs.max():
    ext = np.logspace(np.log10(xs.max()), np.log10(hi), 50)
    right.plot(ext, scaling.predict(ext), "--", color="C1", label="extrapolation (not measured)")
    right.plot([extrapolate_to], scaling.predict(extrapolate_to), "x", color="C1", ms=9)
  right.set_xscale("log")
  right.set_xlabel("training examples")
  right.set_ylabel("engine τ")
  right.set_title("τ against data")
  right.grid(alpha=0.3, which="both")
  right.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
