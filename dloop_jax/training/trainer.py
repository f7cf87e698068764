"""Drafter training: sharded jit train step, checkpoint / resume, logging, export.

Flow of `train(config, workdir)`:

    target (frozen)  ->  drafter = build_drafter(config.drafter, target)   inside the mesh
    split: params (nnx.Param, trained) | frozen (target-shared) | rng | model_state
    params, AdamW state: NamedSharding from the logical rules (fsdp / tensor)
    data: Grain iterator of numpy batches, checked against the drafter's taps
    resume from <workdir>/checkpoints (newest readable step), else `init_from`,
          else (reduced draft vocabulary) the most frequent response tokens of
          the training split become the draft vocabulary
    loop: batch -> global arrays over (data, fsdp) -> jit step (donates the
          state) -> metrics (JSONL, TensorBoard, progress bar) -> async save
    export <workdir>/export: the drafter alone, for `load_drafter`

The pieces (target, drafter, loss, data) come from `hooks`; the metrics
file, TensorBoard and progress bar from `metrics_writer`; the engine and
held-out evaluations, with the best-drafter export, from `evaluation`.

Determinism: update i uses the key `fold_in(key(seed), i)` and the i-th batch
of the iterator, whose position is part of every checkpoint, so a run killed
at any point and restarted reproduces the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from dloop_jax import flat_state
from dloop_jax import mesh as mesh_lib
from dloop_jax import plain_values
from dloop_jax.drafters import io as drafter_io
from dloop_jax.drafters import variables as variables_lib
from dloop_jax.drafters import vocab as vocab_lib
from dloop_jax.errors import ConfigError, DrafterMismatchError
from dloop_jax.recorded_paths import recorded_path
from dloop_jax.training import checkpointing as ckpt_lib
from dloop_jax.training import config as config_lib
from dloop_jax.training import distributed as distributed_lib
from dloop_jax.training import evaluation
from dloop_jax.training import heldout as heldout_lib
from dloop_jax.training import online as online_lib
from dloop_jax.training import optim as optim_lib
from dloop_jax.training import sharding as sharding_lib
# BEST_DIR, METRICS_FILE, Target, TrainHooks, default_hooks and load_hooks are
# defined with the pieces of a run, and importable from here too (`__all__`).
from dloop_jax.training.evaluation import BEST_DIR
from dloop_jax.training.hooks import (Target, TrainHooks, data_pipeline, default_hooks,
                                      default_token_counts, library_function, load_hooks)
from dloop_jax.training.metrics_writer import (METRICS_FILE, MetricsWriter, host_scalar,
                                               progress_bar)

__all__ = ["BEST_DIR", "CHECKPOINT_DIR", "EXPORT_DIR", "METRICS_FILE", "Target", "TrainHooks",
           "TrainResult", "Trainer", "default_hooks", "load_hooks", "train"]

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "export"


# --------------------------------------------------------------- the state
def _template(state: nnx.State) -> list[tuple[tuple, nnx.Variable]]:
  """Abstract flat template of a state (metadata kept, arrays dropped)."""
  return [(path, var.replace(jax.ShapeDtypeStruct(np.shape(var.get_value()),
                                                 var.get_value().dtype)))
          for path, var in nnx.to_flat_state(state)]


def _rebuild(template: list[tuple[tuple, nnx.Variable]], values: Mapping[str, Any]) -> nnx.State:
  return nnx.from_flat_state([(path, var.replace(values[flat_state.flat_key(path)]))
                              for path, var in template])


def _cast_floating(values: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
  """Floating arrays in `dtype`; integer ones (vocabulary maps, counters) as they are."""
  return {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v
          for k, v in values.items()}


def _place(values: Mapping[str, Any], shardings: Mapping[str, Any]) -> dict[str, jax.Array]:
  # Copies: a drafter may start from the target's own arrays (EAGLE-3's final
  # norm), and the train step donates its parameters; an alias would delete
  # the target's weights with the first update.
  return {k: jax.device_put(v, shardings[k], may_alias=False) for k, v in values.items()}


class Trainer:
  """One training run's state and jit-compiled step.

  Attributes:
    params: {flat name: array} trainable weights, sharded.
    opt_state: optax state, sharded like params.
    step: updates done.
  """

  def __init__(self, config: ml_collections.ConfigDict, *, hooks: TrainHooks | None = None,
               devices: list[jax.Device] | None = None):
    config_lib.validate(config)
    if jax.process_count() > 1:
      distributed_lib.check_same_config(config)
    self.config = config
    self.hooks = hooks or load_hooks(config.hooks)
    self.mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    self.rules = sharding_lib.normalize_rules(config.sharding.rules)
    self.min_shard_size = int(config.sharding.min_shard_size)
    global_batch = int(config.data.batch_size)
    div = sharding_lib.batch_divisor(self.mesh)
    if global_batch % div or global_batch % jax.process_count():
      raise ConfigError(
          f"data.batch_size={global_batch} must be a multiple of data x fsdp = {div} (mesh"
          f" {dict(self.mesh.shape)}) and of the process count {jax.process_count()}.")
    self.local_batch_size = global_batch // jax.process_count()

    self.target = self.hooks.build_target(config.target)
    # Created inside the mesh and the logical rules: flax 0.12 shards
    # variables annotated with `out_sharding` eagerly, and needs both in scope.
    with mesh_lib.mesh_context(self.mesh, self.rules):
      drafter = self.hooks.build_drafter(plain_values.to_plain(config.drafter),
                                         target=self.target.model,
                                         rngs=nnx.Rngs(int(config.seed)))
    self.drafter = drafter
    if hasattr(drafter, "check_target"):
      drafter.check_target(self.target.model.config)
    self.graphdef, params, frozen, rng, model_state = variables_lib.split_drafter(drafter)
    self._templates = {name: _template(s) for name, s in
                       (("params", params), ("frozen", frozen), ("rng", rng),
                        ("model_state", model_state))}

    def shardings(state):
      return sharding_lib.flat_shardings(state, mesh=self.mesh, rules=self.rules,
                                         min_size=self.min_shard_size)

    self.replicated = sharding_lib.replicated(self.mesh)
    self.param_shardings = shardings(params)
    self.frozen_shardings = shardings(frozen)
    self.model_state_shardings = shardings(model_state)
    self.params = _place(flat_state.flat_values(params), self.param_shardings)
    self.frozen = _place(flat_state.flat_values(frozen), self.frozen_shardings)
    # What the step reads: the frozen arrays (the target's embedding / head) are
    # never updated, so they are cast to compute_dtype once here, not per step.
    self.frozen_for_step = _cast_floating(self.frozen, jnp.dtype(config.compute_dtype))
    self.model_state = _place(flat_state.flat_values(model_state), self.model_state_shardings)
    self.rng_state = jax.device_put(rng, self.replicated)
    if not self.params:
      raise ConfigError(f"Drafter {type(drafter).__name__} has no nnx.Param to train.")
    sharding_lib.log_layout(self.param_shardings, {k: v.shape for k, v in self.params.items()},
                            f"Trainable parameters ({self.num_params():,})")

    self.tx, self.schedule = optim_lib.make_optimizer(config.optim,
                                                      total_steps=int(config.num_steps))
    self.opt_shardings = optim_lib.opt_state_shardings(
        self.tx, self.params, self.param_shardings, self.replicated)
    self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
    self.step = 0
    self._steps: dict[Any, Callable] = {}
    self.base_key = jax.random.key(int(config.seed))
    self.online = self._online_target() if config.data.online else None

  def _online_target(self) -> online_lib.OnlineTarget:
    """The target's weights on the mesh for the online step, computing what the objective reads."""
    c = self.config
    needs_fn = library_function("dloop_jax.training.objectives", "target_needs")
    distribution, last_hidden = needs_fn(c.objective, c.objective_cfg, self.drafter)
    dtype = online_lib.resolve_dtype(c.data.online_dtype, target_dtype=c.target.dtype)
    needs = online_lib.Needs(taps=tuple(int(t) for t in self.drafter.taps),
                             distribution=distribution, topk=int(c.data.online_topk),
                             last_hidden=last_hidden)
    target = online_lib.OnlineTarget(self.target.model, mesh=self.mesh, dtype=dtype, needs=needs)
    logging.info("Online training: the target (%s) computes taps %s%s%s in the train step.",
                 dtype, list(needs.taps),
                 (f", its top-{needs.topk} distribution" if needs.topk else
                  ", its distribution") if distribution else "",
                 ", its last layer's output" if last_hidden else "")
    return target

  # ------------------------------------------------------- draft vocabulary
  @property
  def reduced_vocab(self) -> bool:
    return bool(getattr(self.drafter, "reduced_vocab", False))

  def set_draft_vocab(self, counts: np.ndarray) -> np.ndarray:
    """Draft vocabulary = the most frequent ids of `counts`, before training.

    As `build_drafter(..., token_counts=counts)` would: the maps change and the
    head restarts from the target's columns; the optimizer state restarts.
    Returns d2t.
    """
    size = int(variables_lib.drafter_config_of(self.drafter)["draft_vocab_size"])
    d2t, _ = vocab_lib.draft_vocab_from_counts(counts, size)
    drafter = self.drafter_with()
    with mesh_lib.mesh_context(self.mesh, self.rules):
      drafter.set_draft_vocab(d2t, target=self.target.model)
    graphdef, params, frozen, _, model_state = variables_lib.split_drafter(drafter)

    def layout(template):
      return [(path, var.get_value().shape) for path, var in template]

    for name, state in (("params", params), ("frozen", frozen), ("model_state", model_state)):
      template = _template(state)
      # The shardings and the optimizer were made for the old layout.
      if layout(self._templates[name]) != layout(template):
        raise ConfigError(f"{type(drafter).__name__}.set_draft_vocab changed the {name} layout.")
      self._templates[name] = template
    self.graphdef = graphdef
    self.drafter = drafter
    self.params = _place(flat_state.flat_values(params), self.param_shardings)
    self.model_state = _place(flat_state.flat_values(model_state), self.model_state_shardings)
    self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
    return d2t

  # ---------------------------------------------------------------- helpers
  def num_params(self) -> int:
    return int(sum(math.prod(v.shape) for v in self.params.values()))

  def drafter_with(self, params: Mapping[str, jax.Array] | None = None, *,
                   on_host: bool = False) -> nnx.Module:
    """The drafter module holding `params` (default: the current ones).

    `on_host`: numpy copies of every array (unsharded, off the mesh), what
    `generate()` on the unsharded target runs (the engine evaluation).
    """
    t = self._templates
    get = ((lambda values: {k: np.asarray(v) for k, v in jax.device_get(dict(values)).items()})
           if on_host else (lambda values: values))
    rng_state = jax.device_get(self.rng_state) if on_host else self.rng_state
    return nnx.merge(self.graphdef, _rebuild(t["params"], get(params or self.params)),
                     _rebuild(t["frozen"], get(self.frozen)), rng_state,
                     _rebuild(t["model_state"], get(self.model_state)))

  def meta(self) -> dict[str, Any]:
    """What a checkpoint records about the run (checked on resume)."""
    d = self.drafter
    return {
        "drafter_kind": getattr(d, "kind", None),
        "drafter_class": type(d).__name__,
        "drafter_config": variables_lib.drafter_config_of(d),
        "taps": list(getattr(d, "taps", ())),
        "target": {"name": self.target.name,
                   "fingerprint": dict(self.target.model.config.fingerprint)},
        "objective": self.config.objective,
        "config": plain_values.to_plain(self.config),
    }

  def check_meta(self, meta: Mapping[str, Any], *, where: str) -> None:
    """Raises when `meta` (of a checkpoint) belongs to another drafter or target."""
    mine = self.meta()
    theirs_target = meta.get("target", {})
    if dict(theirs_target.get("fingerprint", {})) != mine["target"]["fingerprint"]:
      raise DrafterMismatchError(
          f"{where} holds a drafter trained for target {theirs_target.get('name')!r}"
          f" ({theirs_target.get('fingerprint')}); this run's target is"
          f" {mine['target']['name']!r} ({mine['target']['fingerprint']}). Use another"
          " --workdir (or init_from) for this target.")
    if theirs_target.get("name") != mine["target"]["name"]:
      raise DrafterMismatchError(
          f"{where} holds a drafter trained for target {theirs_target.get('name')!r}; this"
          f" run's target is {mine['target']['name']!r} (same shape, other weights). Use"
          " another --workdir for this target.")
    if meta.get("drafter_kind") != mine["drafter_kind"]:
      raise ConfigError(
          f"{where} holds a {meta.get('drafter_kind')!r} drafter; this config trains a"
          f" {mine['drafter_kind']!r} drafter. Use another --workdir, or a config for"
          f" {meta.get('drafter_kind')!r}.")
    theirs_cfg, mine_cfg = meta.get("drafter_config", {}), mine["drafter_config"]
    if theirs_cfg != mine_cfg:
      keys = sorted(set(theirs_cfg) | set(mine_cfg))
      diffs = [f"{k}: checkpoint {theirs_cfg.get(k)!r}, config {mine_cfg.get(k)!r}"
               for k in keys if theirs_cfg.get(k) != mine_cfg.get(k)]
      raise ConfigError(f"{where} holds a drafter with another configuration ("
                        + "; ".join(diffs) + "). Use another --workdir, or the same drafter"
                        " settings.")

  # ------------------------------------------------------------- train step
  def _compiled_step(self, batch: Mapping[str, jax.Array], *, grads_only: bool = False
                     ) -> Callable:
    """The jitted step for batches like `batch` (compiled once per batch layout).

    `grads_only`: `(params, frozen, model_state, rng_state, target_state,
    batch, step) -> (loss, metrics, grads)` without the update (the
    online / offline equivalence checks).
    """
    signature = (grads_only,) + tuple(sorted((k, v.ndim) for k, v in batch.items()))
    if signature in self._steps:
      return self._steps[signature]
    online = self.online
    templates = self._templates
    graphdef, tx, schedule = self.graphdef, self.tx, self.schedule
    loss_fn, objective = self.hooks.loss_fn, self.config.objective
    objective_cfg = ml_collections.FrozenConfigDict(self.config.objective_cfg)
    base_key = self.base_key
    # Curricula (Domino's) need the fraction of training done; loss functions
    # that take no `progress` (custom hooks) are called as before.
    takes_progress = "progress" in inspect.signature(loss_fn).parameters
    num_steps = max(int(self.config.num_steps), 1)
    compute_dtype = jnp.dtype(self.config.compute_dtype)

    def loss_and_grads(params, frozen, model_state, rng_state, target_state, batch, step):
      key = jax.random.fold_in(base_key, step)
      if online is not None:
        # The frozen target first: its outputs are constants of the loss
        # (`target_state` is not an argument of the differentiated function).
        batch = dict(batch, **online.outputs(target_state, batch))
      # Mixed precision: the forward and backward passes read float copies in
      # compute_dtype (`frozen` comes cast: `frozen_for_step`); the gradients
      # flow back through the casts to the weights' own dtype, which the
      # optimizer updates.
      frozen_state = _rebuild(templates["frozen"], frozen)
      other = _rebuild(templates["model_state"], model_state)

      def loss_of(p):
        drafter = nnx.merge(graphdef,
                            _rebuild(templates["params"], _cast_floating(p, compute_dtype)),
                            frozen_state, rng_state, other)
        extra = {"progress": step / num_steps} if takes_progress else {}
        loss, metrics = loss_fn(drafter, batch, key, objective=objective, cfg=objective_cfg,
                                **extra)
        return loss, metrics

      (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
      return loss, metrics, grads

    def train_step(params, opt_state, frozen, model_state, rng_state, target_state, batch, step):
      loss, metrics, grads = loss_and_grads(params, frozen, model_state, rng_state, target_state,
                                            batch, step)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics = dict(metrics)
      metrics.update(loss=loss, grad_norm=optax.tree.norm(grads),
                     learning_rate=schedule(step))
      return params, opt_state, metrics

    batch_shardings = {k: sharding_lib.batch_sharding(self.mesh, v.ndim)
                       for k, v in batch.items()}
    target_shardings = online.shardings if online is not None else None
    if grads_only:
      fn = jax.jit(
          loss_and_grads,
          in_shardings=(self.param_shardings, self.frozen_shardings, self.model_state_shardings,
                        self.replicated, target_shardings, batch_shardings, self.replicated),
          out_shardings=(self.replicated, self.replicated, self.param_shardings))
    else:
      fn = jax.jit(
          train_step,
          in_shardings=(self.param_shardings, self.opt_shardings, self.frozen_shardings,
                        self.model_state_shardings, self.replicated, target_shardings,
                        batch_shardings, self.replicated),
          out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
          # The old state is dead once the step returns: update it in place.
          donate_argnums=(0, 1),
      )
    self._steps[signature] = fn
    return fn

  def _placed(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    rows = {np.shape(v)[0] for v in batch.values()}
    if rows != {self.local_batch_size}:
      raise ConfigError(f"The data pipeline yielded batches of {sorted(rows)} rows; this"
                        f" process needs {self.local_batch_size} (data.batch_size"
                        f" {self.config.data.batch_size} over {jax.process_count()} processes).")
    if self.online is not None:
      # Token ids only: stored features (if the data hold any) stay on the host.
      batch = online_lib.input_batch(batch)
    return sharding_lib.put_batch(batch, self.mesh)

  def heldout_metrics(self, batches: list[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Teacher-forced acc_k and tau with standard errors on held-out batches (`heldout`).

    One example per row; rows with nothing to predict (empty rows of the
    last batch) count nowhere. The block drafters' anchors come from a key
    fixed per batch, so every evaluation of a run measures the same drafts.
    """
    counts_fn = library_function("dloop_jax.training.objectives", "teacher_forced_counts")
    correct, counted = [], []
    for i, batch in enumerate(batches):
      placed = self._placed({k: v for k, v in batch.items() if k != "example"})
      signature = ("heldout",) + tuple(sorted((k, v.ndim) for k, v in placed.items()))
      if signature not in self._steps:
        self._steps[signature] = self._heldout_fn(placed, counts_fn)
      with mesh_lib.mesh_context(self.mesh, self.rules):
        c, n = self._steps[signature](
            self.params, self.frozen_for_step, self.model_state, self.rng_state,
            None if self.online is None else self.online.state, placed,
            jnp.asarray(i, jnp.int32))
      correct.append(np.asarray(jax.device_get(c)))
      counted.append(np.asarray(jax.device_get(n)))
    return heldout_lib.summarize(np.concatenate(correct), np.concatenate(counted))

  def _heldout_fn(self, batch: Mapping[str, jax.Array], counts_fn: Callable) -> Callable:
    templates, graphdef, online = self._templates, self.graphdef, self.online
    objective = self.config.objective
    objective_cfg = ml_collections.FrozenConfigDict(self.config.objective_cfg)
    compute_dtype = jnp.dtype(self.config.compute_dtype)
    eval_key = jax.random.fold_in(self.base_key, 0x68656C64)

    def counts(params, frozen, model_state, rng_state, target_state, batch, index):
      if online is not None:
        batch = dict(batch, **online.outputs(target_state, batch))
      drafter = nnx.merge(graphdef, _rebuild(templates["params"],
                                             _cast_floating(params, compute_dtype)),
                          _rebuild(templates["frozen"], frozen), rng_state,
                          _rebuild(templates["model_state"], model_state))
      return counts_fn(drafter, batch, jax.random.fold_in(eval_key, index),
                       objective=objective, cfg=objective_cfg)

    batch_shardings = {k: sharding_lib.batch_sharding(self.mesh, v.ndim)
                       for k, v in batch.items()}
    return jax.jit(counts, in_shardings=(
        self.param_shardings, self.frozen_shardings, self.model_state_shardings,
        self.replicated, online.shardings if online is not None else None, batch_shardings,
        self.replicated), out_shardings=(self.replicated, self.replicated))

  def loss_and_grads(self, batch: Mapping[str, np.ndarray]
                     ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """(loss, metrics, gradients {flat name: array}) of the current step on `batch`; no update."""
    placed = self._placed(batch)
    fn = self._compiled_step(placed, grads_only=True)
    with mesh_lib.mesh_context(self.mesh, self.rules):
      return fn(self.params, self.frozen_for_step, self.model_state, self.rng_state,
                None if self.online is None else self.online.state, placed,
                jnp.asarray(self.step, jnp.int32))

  def train_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """One update on a process-local numpy batch; returns device metrics."""
    placed = self._placed(batch)
    fn = self._compiled_step(placed)
    with mesh_lib.mesh_context(self.mesh, self.rules):
      self.params, self.opt_state, metrics = fn(
          self.params, self.opt_state, self.frozen_for_step, self.model_state, self.rng_state,
          None if self.online is None else self.online.state, placed,
          jnp.asarray(self.step, jnp.int32))
    self.step += 1
    return metrics

  # ------------------------------------------------------------- init_from
  def init_from(self, source: str) -> str:
    """Loads weights (not optimizer state) from a workdir or a drafter export."""
    export_dir = None
    try:
      export_dir = drafter_io.resolve(source)
    except Exception:  # pylint: disable=broad-except
      pass
    ckpt_dir = os.path.join(source, CHECKPOINT_DIR)
    if os.path.isdir(ckpt_dir) and ckpt_lib.has_checkpoints(ckpt_dir):
      checkpointer = ckpt_lib.Checkpointer(ckpt_dir, keep=0, async_save=False, read_only=True)
      try:
        step, params, model_state, _ = checkpointer.restore_params(
            abstract_params=ckpt_lib.abstract_like(self.params),
            abstract_model_state=ckpt_lib.abstract_like(self.model_state) or None,
            check_meta=lambda m: self.check_meta(m, where=f"init_from {ckpt_dir}"))
      finally:
        checkpointer.close()
      self.params = dict(params)
      if model_state:
        self.model_state = dict(model_state)
      return f"{ckpt_dir} step {step}"
    if export_dir is not None:
      info = drafter_io.read_info(export_dir)
      self.check_meta({"drafter_kind": info.get("kind"), "drafter_config": info["drafter_config"],
                       "target": info.get("target", {})}, where=f"init_from {export_dir}")
      params, model_state = drafter_io.read_arrays(export_dir, info)
      cast = {k: np.asarray(v).astype(self.params[k].dtype) for k, v in params.items()}
      if set(cast) != set(self.params):
        raise ConfigError(f"init_from {export_dir}: weights {sorted(set(cast) ^ set(self.params))}"
                          " do not match this drafter.")
      self.params = _place(cast, self.param_shardings)
      if model_state:
        self.model_state = _place(model_state, self.model_state_shardings)
      return export_dir
    raise ConfigError(f"init_from={source!r} is neither a training workdir with checkpoints nor"
                      " a drafter export.")


# --------------------------------------------------------------------- run
@dataclasses.dataclass
class TrainResult:
  step: int
  metrics: dict[str, Any]
  export_dir: str | None
  resumed_from: int | None
  init_from: str | None
  compile_s: float
  train_s: float
  stopped_early: bool = False  # eval.patience ended the run before num_steps


def _restore_or_initialize(c: ml_collections.ConfigDict, trainer: Trainer, *,
                           checkpointer: ckpt_lib.Checkpointer, iterator: Any, data_info: Any,
                           hooks: TrainHooks) -> tuple[int | None, str | None, dict[str, Any]]:
  """Resumes from the newest readable checkpoint, else applies init_from or a fresh vocab.

  Returns (resumed_from step, init_from source, metrics of the resumed step).
  """
  where = f"Checkpoint directory {checkpointer.directory}"
  restored = checkpointer.restore_latest(
      abstract_params=ckpt_lib.abstract_like(trainer.params),
      abstract_opt_state=ckpt_lib.abstract_like(trainer.opt_state),
      abstract_model_state=ckpt_lib.abstract_like(trainer.model_state) or None,
      check_meta=lambda m: trainer.check_meta(m, where=where))
  resumed_from = init_source = None
  last: dict[str, Any] = {}
  if restored is not None:
    trainer.params = dict(restored.params)
    trainer.opt_state = restored.opt_state
    if restored.model_state:
      trainer.model_state = dict(restored.model_state)
    trainer.step = restored.step
    iterator.set_state(restored.data_state)
    resumed_from = restored.step
    last = dict(restored.meta.get("metrics") or {})
    logging.info("Resumed from %s step %d%s.", checkpointer.directory, restored.step,
                 f" (skipped unreadable steps {restored.skipped})" if restored.skipped else "")
    if restored.skipped:
      print(f"warning: checkpoint step(s) {restored.skipped} in {checkpointer.directory} were"
            f" corrupted and moved aside; resumed from step {restored.step}.", file=sys.stderr)
  elif c.init_from:
    init_source = trainer.init_from(c.init_from)
    logging.info("Initialized the drafter's weights from %s.", init_source)
  else:
    if trainer.reduced_vocab:
      # A resumed or init_from drafter brings its maps (stored with its
      # weights); a fresh one drafts the most frequent tokens of this data.
      start = time.perf_counter()
      count_fn = hooks.token_counts or default_token_counts
      subset = {"max_examples": int(c.data.max_examples)} if c.data.max_examples else {}
      counts = np.asarray(count_fn(data_info,
                                   vocab_size=int(trainer.target.model.config.vocab_size),
                                   **subset))
      d2t = trainer.set_draft_vocab(counts)
      logging.info("Draft vocabulary: the %d most frequent token ids, %.1f %% of the %d response"
                   " tokens of the training data (counted in %.1f s).", d2t.size,
                   100 * counts[d2t].sum() / max(counts.sum(), 1), int(counts.sum()),
                   time.perf_counter() - start)
    if c.objective == "loop_aware":
      logging.warning("Loop-aware training from a random drafter: the recipe fine-tunes a"
                      " normally trained one (set init_from to its workdir or export).")

  return resumed_from, init_source, last


def _check_soft_targets(c: ml_collections.ConfigDict, data_info: Any) -> None:
  """Soft targets offline need a dataset holding the target's top-k (fails before training)."""
  cfg = c.objective_cfg
  soft = any(float(cfg.get(k) or 0) for k in ("kl_weight", "tv_weight"))
  if c.data.online or not soft or not isinstance(data_info, (str, os.PathLike)):
    return
  meta = data_pipeline().dataset_metadata(data_info)
  if not int((meta.get("config") or {}).get("target_topk", 0) or meta.get("target_topk", 0) or 0):
    raise ConfigError(
        f"objective_cfg.kl_weight / tv_weight distill the target's distribution; the dataset at"
        f" {data_info} was built without it (target_topk=0). Train online"
        " (--config.data.online=True), or rebuild the dataset with target_topk > 0.")


def train(config: ml_collections.ConfigDict, workdir: str, *, hooks: TrainHooks | None = None,
          devices: list[jax.Device] | None = None) -> TrainResult:
  """Trains (or resumes training) a drafter in `workdir`; see the module docstring."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  trainer = Trainer(config, hooks=hooks, devices=devices)
  hooks = trainer.hooks
  c = config
  num_steps = int(c.num_steps)

  iterator, data_info = hooks.make_iterator(
      c, target=trainer.target, drafter=trainer.drafter, workdir=workdir,
      batch_size=trainer.local_batch_size, shard_index=jax.process_index(),
      shard_count=jax.process_count())
  online_arg = ({"online": True} if c.data.online
                and "online" in inspect.signature(hooks.check_dataset).parameters else {})
  hooks.check_dataset(data_info, drafter=trainer.drafter, target=trainer.target, **online_arg)
  _check_soft_targets(c, data_info)

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                       keep=int(c.checkpoint.keep),
                                       async_save=bool(c.checkpoint.async_save))
  try:
    resumed_from, init_source, last = _restore_or_initialize(
        c, trainer, checkpointer=checkpointer, iterator=iterator, data_info=data_info,
        hooks=hooks)
    evaluator, best = evaluation.engine_evaluation(c, trainer, workdir)
    heldout = evaluation.heldout_batches(c, trainer, hooks, data_info)
    if heldout is not None and evaluator is None:
      best = evaluation.resumed_best(c, trainer, workdir)
  except BaseException:
    # Orbax's background threads (temporary-directory cleanup, async saves)
    # must end before the interpreter does, or they print tracebacks at exit.
    checkpointer.close()
    raise
  writer = MetricsWriter(workdir, start_step=trainer.step, tensorboard=bool(c.tensorboard))
  bar = progress_bar(num_steps, trainer.step, bool(c.progress_bar))
  meta = trainer.meta()
  if init_source:
    meta["init_from"] = init_source
  tokens_per_step = int(c.data.batch_size) * int(c.data.seq_len)
  compile_s = 0.0
  # Fraction of the window's row positions that hold example tokens (not
  # padding), from this process's rows: what packing raises.
  window_start, window_steps, window_fill = time.perf_counter(), 0, 0.0
  loop_start = time.perf_counter()
  first_step = trainer.step

  def save():
    checkpointer.save(trainer.step, params=trainer.params, opt_state=trainer.opt_state,
                      model_state=trainer.model_state, data_state=iterator.get_state(),
                      meta=dict(meta, metrics=last))

  patience = int(c.eval.patience) if (evaluator is not None or heldout is not None) else 0
  stopped_early = False
  try:
    while trainer.step < num_steps:
      if best.stop(patience):
        stopped_early = True
        message = (f"Early stop at step {trainer.step}: {best.evals_since} evaluations without a"
                   f" better {c.eval.keep_best} than {best.score:.3f} (step {best.step},"
                   f" exported to {os.path.join(workdir, BEST_DIR)}); eval.patience={patience}.")
        if bar is not None:
          bar.write(message)
        logging.info(message)
        if checkpointer.latest_step() != trainer.step:
          save()
        break
      try:
        batch = next(iterator)
      except StopIteration:
        logging.warning("The data iterator ended at step %d of %d; stopping there.",
                        trainer.step, num_steps)
        if not checkpointer.steps() or checkpointer.latest_step() != trainer.step:
          save()
        break
      metrics = trainer.train_step(batch)
      window_steps += 1
      if "segment_ids" in batch:
        window_fill += float(np.count_nonzero(batch["segment_ids"])) / np.size(batch["segment_ids"])
      if trainer.step == first_step + 1:
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - loop_start
        window_start, window_steps, window_fill = time.perf_counter(), 0, 0.0
      if trainer.step % int(c.log_every_steps) == 0 or trainer.step == num_steps:
        host = {k: host_scalar(v) for k, v in jax.device_get(metrics).items()}
        elapsed = time.perf_counter() - window_start
        if window_steps:
          host["steps_per_s"] = window_steps / max(elapsed, 1e-9)
          host["tokens_per_s"] = host["steps_per_s"] * tokens_per_step
          if window_fill:
            host["example_tokens_per_s"] = host["tokens_per_s"] * window_fill / window_steps
        window_start, window_steps, window_fill = time.perf_counter(), 0, 0.0
        last = host
        writer.write(trainer.step, host)
        if bar is not None:
          post = {"loss": f"{host['loss']:.4f}"}
          if "expected_acceptance_length" in host:
            post["tau"] = f"{host['expected_acceptance_length']:.2f}"
          if "tokens_per_s" in host:
            post["tok/s"] = f"{host['tokens_per_s']:.0f}"
          bar.set_postfix(post, refresh=False)
        else:
          logging.info("step %d: %s", trainer.step, {k: host[k] for k in sorted(host)})
      if evaluator is not None and (trainer.step % int(c.eval.every_steps) == 0
                                    or trainer.step == num_steps):
        eval_start = time.perf_counter()
        evaluation.engine_evaluate(evaluator, trainer, workdir, c, best=best, last=last,
                                   writer=writer, bar=bar)
        window_start += time.perf_counter() - eval_start  # not training time
      if heldout is not None and (trainer.step % int(c.eval.heldout_every_steps) == 0
                                  or trainer.step == num_steps):
        eval_start = time.perf_counter()
        evaluation.heldout_evaluate(heldout, trainer, workdir, c, best=best, last=last,
                                    writer=writer, bar=bar)
        window_start += time.perf_counter() - eval_start
      if bar is not None:
        bar.update(1)
      if trainer.step % int(c.checkpoint.every_steps) == 0 or trainer.step == num_steps:
        save()
    checkpointer.wait()
    train_s = time.perf_counter() - loop_start
    export_dir = None
    if c.export.enabled:
      export_dir = drafter_io.export_drafter(
          trainer.drafter_with(), c.export.path or os.path.join(workdir, EXPORT_DIR),
          target_name=trainer.target.name, metrics=last,
          extra={"step": trainer.step, "objective": c.objective,
                 "init_from": init_source or "", "workdir": recorded_path(workdir)})
  finally:
    if bar is not None:
      bar.close()
    writer.close()
    checkpointer.close()
  return TrainResult(step=trainer.step, metrics=last, export_dir=export_dir,
                     resumed_from=resumed_from, init_from=init_source, compile_s=compile_s,
                     train_s=train_s, stopped_early=stopped_early)
