"""Optimizer: AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from dloop_jax.errors import ConfigError


def learning_rate_schedule(*, learning_rate: float, warmup_steps: int, total_steps: int,
                           end_lr_ratio: float = 0.1) -> optax.Schedule:
  """0 -> `learning_rate` over `warmup_steps`, then cosine to `end_lr_ratio * lr`."""
  if learning_rate <= 0:
    raise ConfigError(f"optim.learning_rate must be > 0, got {learning_rate}.")
  if not 0 <= end_lr_ratio <= 1:
    raise ConfigError(f"optim.end_lr_ratio must be in [0, 1], got {end_lr_ratio}.")
  warmup_steps = max(0, min(int(warmup_steps), int(total_steps)))
  # optax counts the warmup inside decay_steps and needs a cosine part.
  decay_steps = max(int(total_steps), warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=decay_steps, end_value=learning_rate * end_lr_ratio)


def _decay_mask(params: Mapping[str, Any]) -> dict[str, bool]:
  # No weight decay on norm scales and biases (vectors), as usual for transformers.
  return {k: getattr(v, "ndim", 0) >= 2 for k, v in params.items()}


def make_optimizer(optim_config: Mapping[str, Any], *, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW over a flat `{name: array}` parameter dict.

  Args:
    optim_config: `config.optim` (learning_rate, warmup_steps, end_lr_ratio,
      weight_decay, b1, b2, eps, grad_clip_norm).
    total_steps: length of the schedule (the run's `num_steps`).

  Returns:
    (transformation, learning-rate schedule).
  """
  c = optim_config
  schedule = learning_rate_schedule(
      learning_rate=float(c["learning_rate"]), warmup_steps=int(c["warmup_steps"]),
      total_steps=total_steps, end_lr_ratio=float(c["end_lr_ratio"]))
  chain = []
  if c["grad_clip_norm"] and float(c["grad_clip_norm"]) > 0:
    chain.append(optax.clip_by_global_norm(float(c["grad_clip_norm"])))
  chain.append(optax.adamw(schedule, b1=float(c["b1"]), b2=float(c["b2"]), eps=float(c["eps"]),
                           weight_decay=float(c["weight_decay"]), mask=_decay_mask))
  return optax.chain(*chain), schedule


def opt_state_shardings(tx: optax.GradientTransformation, params: Mapping[str, jax.Array],
                        param_shardings: Mapping[str, NamedSharding],
                        replicated: NamedSharding) -> Any:
  """Shardings of `tx.init(params)`: moments like their parameters, scalars replicated."""
  abstract = jax.eval_shape(tx.init, params)
  return optax.tree_map_params(
      tx, lambda _, s: s, abstract, param_shardings,
      transform_non_params=lambda _: replicated)
