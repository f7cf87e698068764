"""Tiny drafter training data and a plain optax loop (tests of the product drafters).

Data: the tiny target answers random prompts greedily (`generate(...,
capture_taps=taps)`), so the features are exactly the taps it computes, as in
the `target_responses` dataset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dloop_jax.decoding import generate
from dloop_jax.training import objectives


def make_examples(target, *, taps, num_prompts: int, max_new_tokens: int, seed: int,
                  min_prompt: int = 3, max_prompt: int = 8) -> list[dict[str, np.ndarray]]:
  """Prompt + greedy response, loss mask on the response, taps at every position."""
  rng = np.random.default_rng(seed)
  vocab = target.config.vocab_size
  prompts = [rng.integers(0, vocab, size=int(rng.integers(min_prompt, max_prompt + 1))).tolist()
             for _ in range(num_prompts)]
  out = generate(target, prompts, max_new_tokens=max_new_tokens, capture_taps=tuple(taps))
  examples = []
  for prompt, response, feats in zip(prompts, out.tokens, out.features):
    tokens = np.asarray(prompt + response, np.int32)
    n = tokens.shape[0]
    features = np.zeros((n,) + feats.shape[1:], np.float32)
    features[:feats.shape[0]] = feats  # the last token is never read: zeros
    mask = np.zeros((n,), np.int32)
    mask[len(prompt):] = 1
    examples.append(dict(tokens=tokens, loss_mask=mask, features=features, prompt=prompt))
  return examples


def pack_batch(examples: list[dict[str, np.ndarray]], *, seq_len: int,
               per_row: int = 1) -> dict[str, np.ndarray]:
  """Rows of `per_row` examples each, packed left to right and padded to seq_len."""
  rows = [examples[i:i + per_row] for i in range(0, len(examples), per_row)]
  b = len(rows)
  d_shape = examples[0]["features"].shape[1:]
  batch = dict(tokens=np.zeros((b, seq_len), np.int32), loss_mask=np.zeros((b, seq_len), np.int32),
               features=np.zeros((b, seq_len) + d_shape, np.float32),
               segment_ids=np.zeros((b, seq_len), np.int32),
               positions=np.zeros((b, seq_len), np.int32))
  for r, row in enumerate(rows):
    at = 0
    for s, ex in enumerate(row):
      n = min(ex["tokens"].shape[0], seq_len - at)
      if n <= 0:
        break
      for k in ("tokens", "loss_mask", "features"):
        batch[k][r, at:at + n] = ex[k][:n]
      batch["segment_ids"][r, at:at + n] = s + 1
      batch["positions"][r, at:at + n] = np.arange(n)
      at += n
  return batch


def split(drafter):
  graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
  return graphdef, params, rest


@functools.lru_cache(maxsize=None)
def _train_step(graphdef, objective: str, cfg_items: tuple, tx_id: int):
  cfg = dict(cfg_items)
  tx = _TX[tx_id]

  @jax.jit
  def step(params, rest, opt_state, batch, key, progress):
    def loss_of(p):
      drafter = nnx.merge(graphdef, p, rest)
      return objectives.loss_fn(drafter, batch, key, objective=objective, cfg=cfg,
                                progress=progress)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  return step


_TX: dict[int, optax.GradientTransformation] = {}


def train(drafter, batches: list[dict[str, np.ndarray]], *, objective: str, cfg: dict,
          steps: int, learning_rate: float = 3e-3, seed: int = 0) -> list[dict[str, float]]:
  """Adam on `drafter`'s nnx.Params in place; returns the metrics of every step.

  The loss sees the fraction of training done as `progress` (Domino's curriculum).
  """
  graphdef, params, rest = split(drafter)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))
  tx_id = len(_TX)
  _TX[tx_id] = tx
  step = _train_step(graphdef, objective, tuple(sorted(cfg.items())), tx_id)
  opt_state = tx.init(params)
  device_batches = [jax.tree.map(jnp.asarray, b) for b in batches]
  history = []
  key = jax.random.key(seed)
  for i in range(steps):
    params, opt_state, metrics = step(params, rest, opt_state, device_batches[i % len(batches)],
                                      jax.random.fold_in(key, i), jnp.float32(i / steps))
    history.append(metrics)
  nnx.update(drafter, params)
  return [{k: float(v) for k, v in m.items()} for m in jax.device_get(history)]


# ------------------------------------------------- jitted drafter calls (unit tests)
@nnx.jit
def commit(drafter, state, tokens, features, next_tokens, starts, counts):
  return drafter.commit(state, tokens=tokens, features=features, next_tokens=next_tokens,
                        starts=starts, counts=counts)


@functools.partial(nnx.jit, static_argnames=("block_size", "sampling"))
def draft_stage(drafter, state, key, *, block_size, sampling):
  return drafter.draft_stage(state, key=key, block_size=block_size, sampling=sampling)


def commit_prefix(drafter, tokens: np.ndarray, features: np.ndarray, n: int, capacity: int = 64):
  """State after committing positions 0..n-1 of each row (as the prefill does)."""
  b = tokens.shape[0]
  state = drafter.init_state(batch_size=b, capacity=capacity)
  nxt = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
  return commit(drafter, state, jnp.asarray(tokens[:, :n]), jnp.asarray(features[:, :n]),
                jnp.asarray(nxt[:, :n]), jnp.zeros((b,), jnp.int32), jnp.full((b,), n, jnp.int32))


# ------------------------------------------------------------------- sizing
def smollm2_shaped_config():
  """The default target's shape (SmolLM2-135M: 30 layers, D 576, vocab 49152, tied)."""
  from dloop_jax.models.config import TransformerConfig  # pylint: disable=g-import-not-at-top
  return TransformerConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           tie_embeddings=True)


def abstract_drafter(config: dict, target_config):
  """A drafter of `config` for an abstract target of `target_config` (no weights allocated)."""
  from dloop_jax.drafters import build_drafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  return nnx.eval_shape(lambda: build_drafter(
      config, target=Transformer(target_config, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)))


def num_weights(*arrays) -> int:
  return int(sum(np.prod(a.get_value().shape if hasattr(a, "get_value") else a.shape)
                 for a in arrays))
