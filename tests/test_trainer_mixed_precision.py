"""Mixed-precision training: `compute_dtype="bfloat16"` over float32 weights.

The forward and backward passes run in bfloat16 (the matmuls of the compiled
step read bfloat16 operands), while the weights, their gradients and Adam's
moments stay float32, and one step moves the weights as the float32 step does
up to bfloat16 rounding.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

import trainer_hooks
from dloop_jax.errors import ConfigError
from dloop_jax.models.transformer import f32_dot_general
from dloop_jax.training import sharding
from dloop_jax.training import trainer as trainer_lib

DRAFTERS = {
    "eagle3": (dict(kind="eagle3", block_size=2), "eagle3_ttt",
               dict(ttt_steps=2, step_decay=0.8)),
    "block": (dict(kind="block", block_size=3, num_layers=1), "block",
              dict(num_anchors=4)),
}


def _trainer(kind: str, compute_dtype: str, workdir: str):
  drafter, objective, objective_cfg = DRAFTERS[kind]
  c = trainer_hooks.tiny_config(hooks="", data__batch_size=4, compute_dtype=compute_dtype,
                                optim__warmup_steps=0)  # step 0 moves the weights
  c.drafter = ConfigDict(drafter)
  c.objective = objective
  c.objective_cfg = ConfigDict(objective_cfg)
  trainer = trainer_lib.Trainer(c)
  iterator, _ = trainer.hooks.make_iterator(
      c, target=trainer.target, drafter=trainer.drafter, workdir=workdir,
      batch_size=trainer.local_batch_size, shard_index=0, shard_count=1)
  return trainer, next(iterator)


@pytest.mark.parametrize("kind", sorted(DRAFTERS))
def test_bfloat16_compute_keeps_float32_weights_and_follows_the_float32_step(kind, tmp_path):
  reference, batch = _trainer(kind, "float32", str(tmp_path))
  mixed, _ = _trainer(kind, "bfloat16", str(tmp_path))
  for name, value in reference.params.items():
    np.testing.assert_array_equal(np.asarray(mixed.params[name]), np.asarray(value))
  before = {k: np.asarray(v) for k, v in reference.params.items()}

  ref_metrics = reference.train_step(batch)
  mixed_metrics = mixed.train_step(batch)

  assert {v.dtype for v in mixed.params.values()} == {jnp.dtype(jnp.float32)}
  assert {v.dtype for v in jax.tree.leaves(mixed.opt_state)
          if jnp.issubdtype(v.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  ref_loss, mixed_loss = float(ref_metrics["loss"]), float(mixed_metrics["loss"])
  assert np.isfinite(mixed_loss)
  assert abs(mixed_loss - ref_loss) <= 0.02 * abs(ref_loss), (mixed_loss, ref_loss)
  # The update (Adam's first step: about lr * sign(grad)) points the same way.
  ref_update = np.concatenate([(np.asarray(reference.params[k]) - before[k]).ravel()
                               for k in sorted(before)])
  mixed_update = np.concatenate([(np.asarray(mixed.params[k]) - before[k]).ravel()
                                 for k in sorted(before)])
  cosine = ref_update @ mixed_update / (np.linalg.norm(ref_update) * np.linalg.norm(mixed_update))
  assert cosine > 0.9, cosine
  assert not np.array_equal(ref_update, mixed_update)  # bfloat16 did run


def test_bfloat16_step_multiplies_bfloat16_operands(tmp_path):
  trainer, batch = _trainer("eagle3", "bfloat16", str(tmp_path))
  placed = sharding.put_batch(batch, trainer.mesh)
  fn = trainer._compiled_step(placed)  # pylint: disable=protected-access
  hlo = fn.lower(trainer.params, trainer.opt_state, trainer.frozen_for_step, trainer.model_state,
                 trainer.rng_state, None, placed, jnp.asarray(0, jnp.int32)).as_text()
  dots = re.findall(r"stablehlo\.dot_general[^\n]*", hlo)
  operand_types = [re.findall(r"tensor<[^>]*>", d)[:2] for d in dots]
  bf16 = [t for t in operand_types if all("bf16" in x for x in t)]
  # Every matmul of the drafter, forward and backward, reads bfloat16.
  assert dots and len(bf16) == len(dots), [d for d in dots if "bf16" not in d][:3]


def test_f32_dot_general_differentiates_in_the_operands_dtype():
  x = jax.random.normal(jax.random.key(0), (6, 16))
  w = jax.random.normal(jax.random.key(1), (16, 10))
  dims = (((1,), (0,)), ((), ()))

  def loss(product):
    return lambda a, b: jnp.sum(jnp.tanh(product(a, b)) ** 2)

  plain = lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  ours = lambda a, b: f32_dot_general(a, b, dims)
  # f32 operands: exactly autodiff of the plain product.
  for got, want in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(plain), (0, 1))(x, w)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # bf16 operands: an f32 product forward, bf16 gradients close to the f32 ones.
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  assert ours(xb, wb).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ours(xb, wb)), np.asarray(plain(xb, wb)))
  for got, want in zip(jax.grad(loss(ours), (0, 1))(xb, wb), jax.grad(loss(plain), (0, 1))(x, w)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.1, rtol=0.05)


def test_unknown_compute_dtype_is_a_config_error(tmp_path):
  c = trainer_hooks.tiny_config(hooks="", compute_dtype="float16")
  with pytest.raises(ConfigError, match="compute_dtype must be one of"):
    trainer_lib.Trainer(c)
