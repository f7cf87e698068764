"""The target's taps over finished answers: one causal forward, what a build stores.

A build captures the taps while the target decodes; answers stored without
them (`response_store`), or builds that also keep the target's top-k next
tokens, get them from one forward over the finished sequences
(`features_chunk`). Either way the stored features are float16, clipped to
its range (`stored_features`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# Hidden states beyond float16's range (some models have "massive
# activations" at a few positions) are clipped to it, and counted.
F16_MAX = float(np.finfo(np.float16).max)


def stored_features(read: np.ndarray, *, length: int) -> tuple[np.ndarray, int]:
  """[length - 1, n_taps, D] taps -> the stored [length, n_taps, D] float16, and clipped count."""
  feats = np.zeros((length,) + read.shape[1:], np.float16)
  feats[:length - 1] = np.clip(read, -F16_MAX, F16_MAX).astype(np.float16)
  return feats, int(np.count_nonzero(np.abs(read) > F16_MAX))


def _taps_forward_impl(graph, state, tokens, *, taps, topk):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = nnx.merge(graph, state)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  cache = model.init_cache(batch_size=b, capacity=t)
  o = model(tokens, positions=positions, cache=cache, taps=taps, taps_only=not topk)
  if not topk:
    return {"taps": o.taps}
  probs, ids = jax.lax.top_k(jax.nn.softmax(o.logits, axis=-1), topk)
  return {"taps": o.taps, "topk_ids": ids.astype(jnp.int32),
          "topk_probs": probs.astype(jnp.float16)}


def taps_forward(graph, state, tokens, *, taps, topk=0):
  """[B, T] tokens -> {"taps": [B, T, n_taps, D]} of one causal forward (jitted per shape),
  with "topk_ids" / "topk_probs" [B, T, topk] of the target's next-token distributions."""
  global _TAPS_FORWARD_JIT
  if _TAPS_FORWARD_JIT is None:
    import jax  # pylint: disable=g-import-not-at-top
    _TAPS_FORWARD_JIT = jax.jit(_taps_forward_impl, static_argnums=0,
                                static_argnames=("taps", "topk"))
  return _TAPS_FORWARD_JIT(graph, state, tokens, taps=tuple(taps), topk=int(topk))


_TAPS_FORWARD_JIT = None


def features_chunk(answers: dict[str, np.ndarray], *, model: Any, taps: Sequence[int],
                   topk: int, rows: int = 8) -> dict[str, np.ndarray]:
  """A chunk of stored answers with its features: one target forward per `rows` examples.

  The examples are packed by length into forwards of `rows` rows, each padded
  to a multiple of 128 positions (few compiled shapes); the taps of a
  causal forward at position t depend on tokens[:t + 1] only, so padding
  changes nothing, and the values equal the ones captured while decoding up
  to floating-point summation order (tested). With topk=0 (no `target_topk`)
  the forward stops at the last tapped layer and computes no logits.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  offsets = np.concatenate([[0], np.cumsum(answers["lengths"])])
  n = len(answers["index"])
  features: list[np.ndarray | None] = [None] * n
  topk_ids: list[np.ndarray | None] = [None] * n
  topk_probs: list[np.ndarray | None] = [None] * n
  clipped = 0
  t0 = time.perf_counter()
  graph, state = nnx.split(model)
  for group in np.array_split(np.argsort(answers["lengths"], kind="stable"),
                              -(-n // rows)):
    width = -(-int(answers["lengths"][group].max()) // 128) * 128
    tokens = np.zeros((rows, width), np.int32)
    for r, i in enumerate(group):
      tokens[r, :answers["lengths"][i]] = answers["tokens"][offsets[i]:offsets[i + 1]]
    out = jax.device_get(taps_forward(graph, state, tokens, taps=taps, topk=topk))
    tapped = np.asarray(out["taps"], np.float32)
    for r, i in enumerate(group):
      length = int(answers["lengths"][i])
      features[i], n_clipped = stored_features(tapped[r, :length - 1], length=length)
      clipped += n_clipped
      if topk:
        topk_ids[i] = np.zeros((length, topk), np.int32)
        topk_ids[i][:length - 1] = out["topk_ids"][r, :length - 1]
        topk_probs[i] = np.zeros((length, topk), np.float16)
        topk_probs[i][:length - 1] = out["topk_probs"][r, :length - 1]
  arrays = dict(answers, features=np.concatenate(features), clipped=np.asarray(clipped),
                features_seconds=np.asarray(time.perf_counter() - t0))
  if topk:
    arrays.update(target_topk_ids=np.concatenate(topk_ids),
                  target_topk_probs=np.concatenate(topk_probs))
  return arrays
