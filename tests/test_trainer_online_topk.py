"""EAGLE-3 with soft targets on the online top-k path (`data.online_topk`): it trains, and
the top-k of the whole vocabulary is the full distribution."""

from __future__ import annotations

import jax
import numpy as np

from dloop_jax.training import trainer as trainer_lib

from test_trainer_online import _config


def _online(topk: int) -> trainer_lib.Trainer:
  c = _config("tiny.py:eagle3", online=True, kl_weight=1.0, hard_weight=0.1)
  c.data.online_topk = topk
  return trainer_lib.Trainer(c)


def test_eagle3_soft_targets_online_topk(tmp_path):
  full = _online(0)
  vocab = int(full.target.model.config.vocab_size)
  iterator, _ = full.hooks.make_iterator(
      full.config, target=full.target, drafter=full.drafter, workdir=str(tmp_path),
      batch_size=full.local_batch_size, shard_index=0, shard_count=1)
  batch = next(iterator)
  loss_full, _, grads_full = jax.device_get(full.loss_and_grads(batch))
  loss_all, _, grads_all = jax.device_get(_online(vocab).loss_and_grads(batch))
  loss_4, _, grads_4 = jax.device_get(_online(4).loss_and_grads(batch))
  for loss, grads in ((loss_full, grads_full), (loss_4, grads_4)):
    assert np.isfinite(loss) and loss > 0
    assert all(np.isfinite(g).all() for g in grads.values())
    assert max(float(np.abs(g).max()) for g in grads.values()) > 0
  # Top-V renormalized over V tokens is the distribution itself.
  np.testing.assert_allclose(loss_all, loss_full, rtol=1e-5)
  scale = max(float(np.abs(g).max()) for g in grads_full.values())
  for k in grads_full:
    np.testing.assert_allclose(grads_all[k], grads_full[k], rtol=1e-4, atol=1e-5 * scale,
                               err_msg=k)
  # Four of the tiny vocabulary's tokens are another target: the path is really taken.
  assert abs(float(loss_4) - float(loss_full)) > 1e-4 * float(loss_full)
