"""A small stand-in drafter, loss and data for trainer tests.

They follow the contracts of the real pieces (`build_drafter`, `loss_fn`,
`make_iterator` / `check_dataset`) so the trainer, checkpointing and export
are tested on their own. `HOOKS` plugs them in: `--config.hooks=trainer_standin:HOOKS`.

The drafter predicts the next token from the target's tapped features at a
position and its token embedding (shared with the target, frozen):

    x      = tanh(fc(concat(features[t, taps])) + embed[token_t])   [B, T, D]
    h      = (x + tanh(x @ up) @ down) @ w_out                       [B, T, D]
    logits = h @ lm_head                                             [B, T, V]
"""

from __future__ import annotations

import os
import signal
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.data import pipeline
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.drafters import base as base_lib
from dloop_jax.errors import ConfigError
from dloop_jax.models.config import default_taps
from dloop_jax.training import hooks as hooks_lib


class _StandinFrozen(nnx.Variable):
  """Used only until the drafter package defines its Frozen type."""


Frozen = getattr(base_lib, "Frozen", None) or _StandinFrozen


class StandinDrafter(Drafter):
  """A one-layer next-token predictor over target features."""

  def __init__(self, config: dict, *, target, rngs: nnx.Rngs):
    c = target.config
    d = c.hidden_size
    self._config = {k: v for k, v in config.items()}
    self.taps = tuple(config.get("taps") or default_taps(c.num_layers))
    self.fc = nnx.Linear(len(self.taps) * d, d, rngs=rngs)
    self.w_out = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (d, d)))
    # Annotated with logical axes, as real drafters may be: the trainer maps
    # them to mesh axes with its rules table.
    init = nnx.initializers.normal(0.1)
    self.up = nnx.Param(init(rngs.params(), (d, 2 * d)), out_sharding=("embed", "mlp"))
    self.down = nnx.Param(init(rngs.params(), (2 * d, d)), out_sharding=("mlp", "embed"))
    self.embed = Frozen(target.embed[...])
    head = target.embed[...].T if target.lm_head is None else target.lm_head[...]
    self.lm_head = Frozen(head)
    self.kind = str(config.get("kind", "standin"))
    self.block_size = int(config.get("block_size", 3))
    self.target_fingerprint = tuple(sorted(c.fingerprint.items()))
    self.name = "standin"

  def drafter_config(self) -> dict:
    return dict(self._config)

  def __call__(self, tokens: jax.Array, features: jax.Array) -> jax.Array:
    b, t = tokens.shape
    x = self.fc(features.astype(jnp.float32).reshape(b, t, -1)) + self.embed[...][tokens]
    h = jnp.tanh(x)
    h = (h + jnp.tanh(h @ self.up[...]) @ self.down[...]) @ self.w_out[...]
    return h @ self.lm_head[...]


def build_drafter(config, *, target, rngs):
  return StandinDrafter(dict(config), target=target, rngs=rngs)


def loss_fn(drafter, batch, key, *, objective, cfg):
  """Masked next-token cross-entropy; `key` adds a little input noise (so the
  per-step RNG matters for determinism tests)."""
  del objective
  features = batch["features"].astype(jnp.float32)
  noise = float(cfg.get("noise", 0.01))
  features = features + noise * jax.random.normal(key, features.shape)
  logits = drafter(batch["tokens"][:, :-1], features[:, :-1])
  labels = batch["tokens"][:, 1:]
  mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  denom = jnp.maximum(mask.sum(), 1.0)
  loss = (nll * mask).sum() / denom
  acc = ((jnp.argmax(logits, -1) == labels) * mask).sum() / denom
  return loss, {"acc_1": acc, "expected_acceptance_length": 1.0 + acc}


@nnx.jit(static_argnames="taps")
def _tapped(target, tokens, positions, *, taps):
  # One compiled program rather than one per operation: every process of a
  # multi-process test builds these examples.
  cache = target.init_cache(batch_size=tokens.shape[0], capacity=tokens.shape[1])
  return target(tokens, positions=positions, cache=cache, taps=taps).taps


def make_examples(target, *, taps, num_examples: int, seq_len: int, seed: int):
  """Random prompts answered by nobody: tokens plus the target's taps there."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, target.config.vocab_size, (num_examples, seq_len), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (num_examples, seq_len))
  features = np.asarray(_tapped(target, jnp.asarray(tokens), jnp.asarray(positions),
                                taps=tuple(taps)), np.float16)
  return [{"tokens": tokens[i], "loss_mask": np.ones(seq_len, np.int32),
           "features": features[i], "segment_ids": np.ones(seq_len, np.int32),
           "positions": positions[i].copy()} for i in range(num_examples)]


# A run started with this variable set to N SIGKILLs itself once its checkpoint
# of step N is on disk, before step N + 1: every process of a multi-process run
# dies at the same point, which a kill from outside cannot promise.
KILL_AFTER_CHECKPOINT = "DLOOP_STANDIN_KILL_AFTER_CHECKPOINT"


class _KillAfterCheckpoint:
  """Iterator wrapper: SIGKILLs the process when batch `step` (0-based) is asked for."""

  def __init__(self, iterator, *, checkpoint_dir: str, step: int):
    self._it, self._dir, self._step, self._served = iterator, checkpoint_dir, step, 0

  def __iter__(self):
    return self

  def __next__(self):
    if self._served == self._step:
      # The save of step N is asynchronous: wait until it is committed.
      deadline = time.monotonic() + 120
      while not os.path.isdir(os.path.join(self._dir, str(self._step))):
        if time.monotonic() > deadline:
          raise RuntimeError(f"checkpoint {self._step} never appeared in {self._dir}")
        time.sleep(0.01)
      os.kill(os.getpid(), signal.SIGKILL)
    self._served += 1
    return next(self._it)

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)


def make_iterator(config, *, target, drafter, workdir, batch_size, shard_index, shard_count):
  d = config.data
  taps = tuple(d.options.get("taps", drafter.taps))
  examples = make_examples(target.model, taps=taps, num_examples=int(d.num_examples),
                           seq_len=int(d.seq_len), seed=int(d.shuffle_seed))
  # As the real pipeline: the global batches do not depend on the process count.
  ds = grain.MapDataset.source(examples).shuffle(seed=int(d.shuffle_seed)).repeat(None)
  ds = pipeline.process_rows(ds, batch_size=batch_size, shard_index=shard_index,
                             shard_count=shard_count)
  info = {"taps": list(taps), "target_name": target.name,
          "fingerprint": dict(target.model.config.fingerprint)}
  iterator = iter(ds.to_iter_dataset())
  if os.environ.get(KILL_AFTER_CHECKPOINT):
    iterator = _KillAfterCheckpoint(iterator, checkpoint_dir=os.path.join(workdir, "checkpoints"),
                                    step=int(os.environ[KILL_AFTER_CHECKPOINT]))
  return iterator, info


def check_dataset(info, *, drafter, target):
  if tuple(info["taps"]) != tuple(drafter.taps):
    raise ConfigError(f"The dataset holds features of target layers {tuple(info['taps'])};"
                      f" the drafter reads layers {tuple(drafter.taps)}. Rebuild the dataset"
                      " with the drafter's taps.")
  if info["target_name"] != target.name:
    raise ConfigError(f"The dataset was built with target {info['target_name']!r}, this run"
                      f" trains for {target.name!r}.")


HOOKS = hooks_lib.TrainHooks(
    build_target=hooks_lib.default_build_target, build_drafter=build_drafter,
    loss_fn=loss_fn, make_iterator=make_iterator, check_dataset=check_dataset)
