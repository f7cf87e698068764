"""Online training: the frozen target inside the train step (`data.online=True`).

Stored features do not scale (three 4,096-wide taps per token of every
training answer is terabytes at 8B scale). Online, batches carry token ids
(with `loss_mask`, `segment_ids`, `positions`) and the train step runs the
target on them first:

    batch (tokens, loss_mask, segment_ids, positions)
      -> target forward (no gradient: `lax.stop_gradient`, its weights a
         separate argument the step never differentiates), one causal pass
         per row with attention kept inside each packed example
      -> features [B, T, n_taps, D]            as `target_responses` stores them
         target_logits [B, T, V]                when an objective reads the
           or target_topk_ids / _probs [B, T, k]  target's distribution
         target_hidden [B, T, D]                the last decoder layer's output
                                                (feature regression)
      -> the objective, exactly as offline

Features are zero where the data builder stores zeros (padding, and the last
token of each example, which conditions no prediction), so a batch computed
online equals the stored one up to the stored float16 rounding
(`tests/test_trainer_online.py`).

The target's weights are placed with the inference rules of
`dloop_jax.models.sharding` (split over `tensor`, replicated over the batch
axes) on a view of the training mesh whose `data` axis is the training mesh's
`data x fsdp` (the same devices in the same order, so the rows each device
holds are the same in both views).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dloop_jax.errors import ConfigError

# What a stored dataset holds that the online step computes: never read from
# the data in online mode.
COMPUTED_KEYS = ("features", "target_logits", "target_topk_ids", "target_topk_probs",
                 "target_hidden")
# What the online step needs from the data.
INPUT_KEYS = ("tokens", "loss_mask", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Needs:
  """What the objective reads of the target.

  Attributes:
    taps: the drafter's tapped layers (`features`).
    distribution: the target's next-token distribution (`target_logits`, or
      top-k with `topk`).
    topk: 0 = the full distribution; k = its k likeliest tokens, renormalized
      (what offline datasets built with `target_topk` = k hold).
    last_hidden: the last decoder layer's output (`target_hidden`).
  """

  taps: tuple[int, ...]
  distribution: bool = False
  topk: int = 0
  last_hidden: bool = False


def inference_view(mesh: Mesh) -> Mesh:
  """The training mesh (data, fsdp, tensor) as an inference mesh (data x fsdp, 1, tensor)."""
  d, f, t = (mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  devices = np.asarray(mesh.devices).reshape(d * f, 1, t)
  return Mesh(devices, ("data", "fsdp", "tensor"))


class OnlineTarget:
  """The target's weights on the mesh and the forward the train step calls.

  Attributes:
    graphdef: the target's static structure.
    state: its weights (placed), the step's non-differentiated argument.
    shardings: `state`'s shardings (the step's in_shardings).
    needs: what `outputs` computes.
  """

  def __init__(self, model: Any, *, mesh: Mesh, dtype: Any, needs: Needs):
    from dloop_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
    config = model.config
    num_layers = int(config.num_layers)
    bad = [t for t in needs.taps if not -num_layers <= int(t) < num_layers]
    if bad:
      raise ConfigError(f"The drafter taps layers {bad}; the target has {num_layers} decoder"
                        " layers.")
    if needs.topk and needs.topk > int(config.vocab_size):
      raise ConfigError(f"data.online_topk={needs.topk} exceeds the target's vocabulary of"
                        f" {config.vocab_size} tokens.")
    # A copy in the forward's dtype on the inference layout: the drafter's
    # frozen copies (embedding, head) stay as they are.
    placed = Transformer.from_params(config, model.flat_params(), dtype=jnp.dtype(dtype),
                                     mesh=inference_view(mesh))
    self.graphdef, self.state = nnx.split(placed)
    self.shardings = jax.tree.map(lambda x: x.sharding, self.state)
    self.needs = needs
    self.num_layers = num_layers
    self.dtype = jnp.dtype(dtype)

  def outputs(self, state: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """What the objective reads of the target, from the batch's token ids (traced).

    Args:
      state: `self.state` (passed through the jitted step).
      batch: tokens [B, T] and optionally segment_ids / positions [B, T].

    Returns:
      {"features": [B, T, n_taps, D] f32, and per `needs` "target_logits"
      [B, T, V] f32 / "target_topk_ids" [B, T, k] int32 and
      "target_topk_probs" [B, T, k] f32 / "target_hidden" [B, T, D] f32},
      all without gradient.
    """
    if "tokens" not in batch:
      raise ConfigError("data.online=True needs token ids in every batch ('tokens'); the data"
                        f" source yields {sorted(batch)}.")
    n = self.needs
    model = nnx.merge(self.graphdef, jax.lax.stop_gradient(state))
    tokens = jnp.asarray(batch["tokens"]).astype(jnp.int32)
    b, t = tokens.shape
    seg = batch.get("segment_ids")
    seg = jnp.ones((b, t), jnp.int32) if seg is None else jnp.asarray(seg).astype(jnp.int32)
    positions = batch.get("positions")
    positions = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if positions is None
                 else jnp.asarray(positions).astype(jnp.int32))
    # Causal inside each packed example; the diagonal keeps padding rows
    # (segment 0) finite. RoPE reads each example's own positions, so every
    # example sees what a forward over it alone sees.
    idx = jnp.arange(t)
    causal = (idx[:, None] >= idx[None, :])[None]
    mask = ((seg[:, :, None] == seg[:, None, :]) & causal) | jnp.eye(t, dtype=bool)[None]
    taps = tuple(int(x) % self.num_layers for x in n.taps)
    last = self.num_layers - 1
    run_taps = taps + ((last,) if n.last_hidden and last not in taps else ())
    cache = model.init_cache(batch_size=b, capacity=t)
    o = model(tokens, positions=positions, cache=cache, block_mask=mask, taps=run_taps,
              taps_only=not n.distribution)
    # Defined where the stored data hold taps: an example token followed by
    # another token of its example.
    nxt = jnp.pad(seg[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    defined = ((seg > 0) & (nxt == seg)).astype(jnp.float32)
    tapped = o.taps.astype(jnp.float32) * defined[:, :, None, None]
    out = {"features": tapped[:, :, :len(taps)]}
    if n.last_hidden:
      out["target_hidden"] = tapped[:, :, run_taps.index(last)]
    if n.distribution:
      logits = o.logits.astype(jnp.float32)
      if n.topk:
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), n.topk)
        out["target_topk_ids"] = ids.astype(jnp.int32)
        out["target_topk_probs"] = probs * defined[..., None]
      else:
        out["target_logits"] = logits
    return jax.lax.stop_gradient(out)


def resolve_dtype(name: str, *, target_dtype: str) -> str:
  """`data.online_dtype`: "auto" = bfloat16 on accelerators, the target's dtype on CPUs."""
  if name == "auto":
    return "bfloat16" if jax.default_backend() != "cpu" else target_dtype
  if name not in ("float32", "bfloat16"):
    raise ConfigError(f"data.online_dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}.")
  return name


def input_batch(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The keys of a data batch the online step reads (stored features are dropped)."""
  if "tokens" not in batch:
    raise ConfigError("data.online=True needs token ids in every batch ('tokens'); the data"
                      f" source yields {sorted(batch)}.")
  return {k: v for k, v in batch.items() if k not in COMPUTED_KEYS}
