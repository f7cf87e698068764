"""Online training (the target inside the train step) computes what offline
training reads from a stored dataset: the same loss and gradients at step 1.

The offline batch's features are recomputed by the data builder's own forward
(`taps_forward.taps_forward`, one unpacked example at a time, float32:
no float16 storage rounding), the online step runs the target once over the
packed rows with attention kept inside each example. Float32 throughout, so
they agree to summation order (~1e-5 relative); against the stored float16
features the loss agrees to float16 rounding.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dloop_jax.data import pipeline
from dloop_jax.data import taps_forward
from dloop_jax.drafters import build_drafter
from dloop_jax.errors import ConfigError
from dloop_jax.training import objectives
from dloop_jax.training import trainer as trainer_lib

import trainer_hooks


def _config(name: str, *, online: bool, **objective):
  c = trainer_hooks.load_config_file(*name.split(":"))
  c.data.num_examples = 24
  c.data.seq_len = 48
  c.data.batch_size = 4
  c.data.options = {"pack": True, "max_new_tokens": 12}
  c.data.online = online
  c.progress_bar = c.tensorboard = False
  c.optim.warmup_steps = 0
  for k, v in objective.items():
    c.objective_cfg[k] = v
  return c


def _reference_features(trainer, batch, *, logits: bool):
  """Each packed example's taps (and logits) from the data builder's forward, float32."""
  model = trainer.target.model
  graph, state = nnx.split(model)
  taps = tuple(trainer.drafter.taps)
  b, t = batch["tokens"].shape
  features = np.zeros((b, t, len(taps), model.config.hidden_size), np.float32)
  target_logits = np.zeros((b, t, model.config.vocab_size), np.float32)
  for r in range(b):
    seg = batch["segment_ids"][r]
    for s in set(seg[seg > 0].tolist()):
      where = np.flatnonzero(seg == s)
      tokens = batch["tokens"][r, where][None]
      out = taps_forward.taps_forward(graph, state, tokens, taps=taps, topk=0)
      # Stored layout: zero at the example's last token.
      features[r, where[:-1]] = np.asarray(out["taps"][0, :-1], np.float32)
      if logits:
        cache = model.init_cache(batch_size=1, capacity=len(where))
        o = model(tokens, positions=np.arange(len(where))[None], cache=cache)
        target_logits[r, where] = np.asarray(o.logits[0], np.float32)
  out = dict(batch, features=features)
  if logits:
    out["target_logits"] = target_logits
  return out


CASES = [
    ("tiny.py:eagle3", {}),
    # A block backbone with soft targets: the online step computes the
    # target's full distribution too.
    ("tiny.py:domino", {"kl_weight": 0.5, "tv_weight": 0.5}),
]


@pytest.mark.parametrize("name,objective", CASES, ids=[c[0].replace(".py:", "_") for c in CASES])
def test_online_matches_offline_at_step_one(tmp_path, name, objective):
  offline = trainer_lib.Trainer(_config(name, online=False, **objective))
  online = trainer_lib.Trainer(_config(name, online=True, **objective))
  iterator, _ = offline.hooks.make_iterator(
      offline.config, target=offline.target, drafter=offline.drafter, workdir=str(tmp_path),
      batch_size=offline.local_batch_size, shard_index=0, shard_count=1)
  stored = next(iterator)
  assert stored["segment_ids"].max() > 1  # packed rows
  soft = bool(objective)
  reference = _reference_features(offline, stored, logits=soft)
  if not soft:
    # What the data builder stored is these features in float16.
    np.testing.assert_allclose(stored["features"], reference["features"], rtol=2e-3, atol=2e-3)

  loss_on, metrics_on, grads_on = jax.device_get(online.loss_and_grads(stored))
  loss_off, metrics_off, grads_off = jax.device_get(offline.loss_and_grads(reference))
  np.testing.assert_allclose(loss_on, loss_off, rtol=1e-5)
  assert float(loss_on) > 0
  for k in metrics_off:
    np.testing.assert_allclose(metrics_on[k], metrics_off[k], rtol=1e-5, atol=1e-6, err_msg=k)
  scale = max(float(np.abs(g).max()) for g in grads_off.values())
  assert scale > 0
  for k in grads_off:
    np.testing.assert_allclose(grads_on[k], grads_off[k], rtol=1e-4, atol=1e-5 * scale,
                               err_msg=k)
  if not soft:
    loss_stored = jax.device_get(offline.loss_and_grads(stored)[0])
    np.testing.assert_allclose(loss_stored, loss_off, rtol=2e-3)
    # The held-out metric reads the same target outputs: the same hits.
    held = pipeline.heldout_batches(path=str(tmp_path / "data"), seq_len=48, batch_size=4,
                                    heldout_examples=6)
    on = online.heldout_metrics(held)
    off = offline.heldout_metrics([_reference_features(offline, b, logits=False) for b in held])
    assert on == pytest.approx(off, abs=1e-12)
    assert on["heldout_examples"] == 6 and on["heldout_tau_se"] > 0


def test_soft_targets_offline_need_topk_data(tmp_path):
  c = _config("tiny.py:eagle3", online=False, kl_weight=1.0)
  c.num_steps = 1
  with pytest.raises(ConfigError, match="target_topk"):
    trainer_lib.train(c, str(tmp_path))


def test_online_needs_token_ids():
  from dloop_jax.training import online as online_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match="token ids"):
    online_lib.input_batch({"features": np.zeros((2, 4, 2, 8))})


@pytest.mark.parametrize("key,value,match", [
    ("data.online_topk", 4, "online_topk"),
    ("data.online_dtype", "float16", "online_dtype"),
    ("data.heldout_examples", -1, "heldout_examples"),
    ("eval.keep_best", "heldout_tau", "heldout_every_steps"),
])
def test_bad_online_and_heldout_values(key, value, match):
  from dloop_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  c = trainer_hooks.load_config_file("tiny.py", "eagle3")
  section, leaf = key.split(".")
  c[section][leaf] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(c)


def test_feature_regression_is_a_weighted_term_of_the_online_step(tmp_path):
  """EAGLE-1's feature loss: online, w adds w x (a positive regression loss) to the objective;
  offline (no last-layer output stored) and on a drafter without a feature it is refused."""
  offline = trainer_lib.Trainer(_config("tiny.py:eagle3", online=False))
  iterator, _ = offline.hooks.make_iterator(
      offline.config, target=offline.target, drafter=offline.drafter, workdir=str(tmp_path),
      batch_size=offline.local_batch_size, shard_index=0, shard_count=1)
  batch = next(iterator)
  losses, grads = {}, {}
  for w in (0.0, 0.5, 1.0):
    t = trainer_lib.Trainer(_config("tiny.py:eagle3", online=True, feature_regression_weight=w))
    loss, _, g = jax.device_get(t.loss_and_grads(batch))
    losses[w], grads[w] = float(loss), g
  extra = losses[0.5] - losses[0.0]
  assert extra > 1e-3 * losses[0.0]  # a random drafter's state is far from the target's
  np.testing.assert_allclose(losses[1.0] - losses[0.0], 2 * extra, rtol=1e-4)
  assert any(not np.allclose(grads[0.5][k], grads[0.0][k]) for k in grads[0.0])

  stored = trainer_lib.Trainer(_config("tiny.py:eagle3", online=False,
                                       feature_regression_weight=0.5))
  with pytest.raises(ConfigError, match="train online"):
    stored.loss_and_grads(batch)
  domino = build_drafter({"kind": "domino", "block_size": 2}, target=offline.target.model,
                         rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="has none"):
    objectives.loss_fn(domino, batch, jax.random.key(0), objective="domino",
                       cfg={"feature_regression_weight": 0.5})
