"""Evaluations during training: the engine's tau, the held-out metric, and the best drafter.

Every `eval.every_steps` the drafter drafts for the target in the engine
(`engine_eval`); every `eval.heldout_every_steps` it is measured teacher-forced
on held-out examples (`heldout`). The results go to the metrics file, and a
new best `eval.keep_best` exports the drafter to <workdir>/best; `eval.patience`
evaluations without a better one stop the run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.recorded_paths import recorded_path
from dloop_jax.training import config as config_lib
from dloop_jax.training import engine_eval as engine_eval_lib
from dloop_jax.training.hooks import Target, TrainHooks, default_heldout_batches
from dloop_jax.training.metrics_writer import MetricsWriter

BEST_DIR = "best"


class Run(Protocol):
  """What the evaluations read of a run (a `trainer.Trainer`)."""

  step: int
  target: Target

  def drafter_with(self, params: Mapping[str, jax.Array] | None = None, *,
                   on_host: bool = False) -> nnx.Module: ...

  def heldout_metrics(self, batches: list[Mapping[str, np.ndarray]]) -> dict[str, float]: ...


@dataclasses.dataclass
class Best:
  """The best evaluation so far (`eval.keep_best`) and how many evaluations ago it was."""
  score: float = -math.inf
  step: int | None = None
  evals_since: int = 0

  def stop(self, patience: int) -> bool:
    return bool(patience) and self.step is not None and self.evals_since >= patience


def engine_evaluation(c: ml_collections.ConfigDict, trainer: Run, workdir: str
                      ) -> tuple[engine_eval_lib.EngineEval | None, Best]:
  """The run's `EngineEval` (None when `eval.every_steps` is 0) and the best score so far."""
  if not c.eval.every_steps:
    return None, Best()
  if jax.process_count() > 1:
    raise ConfigError("eval.every_steps runs the engine on one process; on a multi-process run"
                      " set it to 0 and evaluate the checkpoints' exports separately.")
  evaluator = engine_eval_lib.from_config(c.eval, target=trainer.target.model,
                                          tokenizer=trainer.target.tokenizer, seed=int(c.seed))
  best = resumed_best(c, trainer, workdir)
  logging.info("Engine evaluation every %d steps: %d prompts, modes %s%s.", c.eval.every_steps,
               len(evaluator.prompts), list(evaluator.modes),
               f", best {c.eval.keep_best} so far {best.score:.3f} (step {best.step})"
               if best.step is not None else "")
  return evaluator, best


def resumed_best(c: ml_collections.ConfigDict, trainer: Run, workdir: str) -> Best:
  """The best `eval.keep_best` of a resumed run's earlier part (from its best export)."""
  best = Best()
  if c.eval.keep_best and os.path.exists(os.path.join(workdir, BEST_DIR, drafter_io.INFO_FILE)):
    # A resumed run keeps the best of its earlier part, and counts the
    # evaluations after it (they ran every `every` steps since its step).
    info = drafter_io.read_info(os.path.join(workdir, BEST_DIR))
    best.score = float(info.get("metrics", {}).get(c.eval.keep_best, -math.inf))
    best.step = int(info.get("extra", {}).get("step", trainer.step))
    every = int(c.eval.heldout_every_steps if c.eval.keep_best == config_lib.HELDOUT_BEST
                else c.eval.every_steps)
    best.evals_since = max(0, trainer.step // every - best.step // every)
  return best


def _keep_if_best(result: Mapping[str, Any], trainer: Run, workdir: str,
                  c: ml_collections.ConfigDict, *, best: Best, last: Mapping[str, Any]) -> str:
  """Exports the drafter to DIR/best when `result` holds a new best `eval.keep_best`.

  Returns what to add to the progress message.
  """
  key = c.eval.keep_best
  if not key or key not in result:
    return ""
  best.evals_since += 1
  if result[key] <= best.score:
    return ""
  best.score, best.step, best.evals_since = result[key], trainer.step, 0
  drafter_io.export_drafter(trainer.drafter_with(on_host=True), os.path.join(workdir, BEST_DIR),
                            target_name=trainer.target.name, metrics=dict(last),
                            extra={"step": trainer.step, "objective": c.objective,
                                   "workdir": recorded_path(workdir)})
  return f" (best so far: exported to {os.path.join(workdir, BEST_DIR)})"


def heldout_batches(c: ml_collections.ConfigDict, trainer: Run, hooks: TrainHooks,
                    data_info: Any) -> list[dict[str, np.ndarray]] | None:
  """This process's rows of the held-out batches (None when eval.heldout_every_steps is 0)."""
  if not c.eval.heldout_every_steps:
    return None
  if c.eval.keep_best == config_lib.HELDOUT_BEST and jax.process_count() > 1:
    raise ConfigError("eval.keep_best='heldout_tau' exports from one process; on a multi-process"
                      " run keep the held-out metric (eval.keep_best='') and export afterwards.")
  fn = hooks.heldout_batches or default_heldout_batches
  batches = fn(c, data_info=data_info, batch_size=int(c.data.batch_size),
               shard_index=jax.process_index(), shard_count=jax.process_count())
  logging.info("Held-out metric every %d steps: the last %d examples of the training split"
               " (%d batches), never trained on.", c.eval.heldout_every_steps,
               c.data.heldout_examples, len(batches))
  return batches


def heldout_evaluate(batches: list[dict[str, np.ndarray]], trainer: Run, workdir: str,
                     c: ml_collections.ConfigDict, *, best: Best, last: dict[str, Any],
                     writer: MetricsWriter, bar: Any) -> None:
  """Measures the held-out metric, logs it, exports the drafter if it is the best."""
  start = time.perf_counter()
  result: dict[str, Any] = trainer.heldout_metrics(batches)
  result["heldout_eval_s"] = time.perf_counter() - start
  summary = (f"heldout_tau {result['heldout_tau']:.3f} ± {result['heldout_tau_se']:.3f}"
             f" ({result['heldout_examples']} examples)")
  _record_evaluation(result, summary=summary, kind="held-out metric",
                     seconds=result["heldout_eval_s"], trainer=trainer, workdir=workdir, c=c,
                     best=best, last=last, writer=writer, bar=bar)


def engine_evaluate(evaluator: engine_eval_lib.EngineEval, trainer: Run, workdir: str,
                    c: ml_collections.ConfigDict, *, best: Best, last: dict[str, Any],
                    writer: MetricsWriter, bar: Any) -> None:
  """Measures the drafter in the engine, logs it, exports it if it is the best (updates `best`)."""
  drafter = trainer.drafter_with(on_host=True)
  result = evaluator(trainer.target.model, drafter)
  summary = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k.startswith("engine_tau"))
  _record_evaluation(result, summary=summary, kind="engine evaluation",
                     seconds=result["engine_eval_s"], trainer=trainer, workdir=workdir, c=c,
                     best=best, last=last, writer=writer, bar=bar)


def _record_evaluation(result: dict[str, Any], *, summary: str, kind: str, seconds: float,
                       trainer: Run, workdir: str, c: ml_collections.ConfigDict,
                       best: Best, last: dict[str, Any], writer: MetricsWriter,
                       bar: Any) -> None:
  """Writes an evaluation's metrics, exports the drafter if it is the best, logs one line."""
  writer.write(trainer.step, result)
  last.update(result)
  summary += _keep_if_best(result, trainer, workdir, c, best=best, last=last)
  message = f"step {trainer.step}: {summary} ({kind}, {seconds:.1f}s)"
  if bar is not None:
    bar.write(message)
  else:
    logging.info(message)

