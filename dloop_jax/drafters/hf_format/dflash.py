"""DFlash (z-lab/dflash) <-> `BlockDrafter`, and the backbone DSpark and Domino share.

    config   architectures ["DFlashDraftModel"], block_size,
             dflash_config {mask_token_id, target_layer_ids}
    weights  fc, hidden_norm, layers.{i}.* (q/k norms), norm

The drafter rotates with its config's RoPE (rope_theta, rope_scaling), as
DFlash's rotary embedding is built from the drafter's config.

A tap is the output of a 0-based decoder layer (default
`round(1 + i (L - 4) / (n - 1))`), upstream transformers' `hidden_states[id + 1]`:
the same as our target's taps except for the last layer, whose transformers
state is after the final norm (refused when read, warned about when written).
DFlash's block is [anchor, mask x (B - 1)] with the mask token embedded by the
target's embedding: our drafters read it the same way (`mask_token_id` in their
config, no mask parameter), and our stage size gamma is B - 1 (each output
predicts the token at its own position in both). A drafter with a learned mask vector is written only when that vector is
a row of the target's embedding (the id of that row is written).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from dloop_jax.drafters.hf_format import common
from dloop_jax.errors import CheckpointFormatError, ModelLoadError

ARCHITECTURE = "DFlashDraftModel"
_BLOCK_DEFAULT = 16  # z-lab's default when config.json has no block_size


def _dflash_default_taps(num_taps: int, num_layers: int) -> list[int]:
  if num_taps == 1:
    return [num_layers // 2]
  return [min(max(round(1 + i * (num_layers - 4) / (num_taps - 1)), 0), num_layers - 1)
          for i in range(num_taps)]


def _check_dflash_options(hf: Mapping[str, Any], dflash: Mapping[str, Any], *,
                          source: str) -> None:
  """Refuses DFlash options our block drafter has no equivalent of (by name and value)."""
  def value(name, default=None):
    return dflash.get(name, hf.get(name, default))

  sliding = [t for t in (hf.get("layer_types") or []) if t != "full_attention"]
  unsupported = {
      "is_causal": value("is_causal") not in (None, False) and value("is_causal"),
      "layer_types": sliding and sorted(set(sliding)),
      "input_embedding_scale": float(value("input_embedding_scale", 1.0)) != 1.0
                               and value("input_embedding_scale"),
      "output_multiplier": float(value("output_multiplier", 1.0)) != 1.0
                           and value("output_multiplier"),
      "final_logit_softcapping": float(value("final_logit_softcapping") or 0) > 0
                                 and value("final_logit_softcapping"),
  }
  bad = {k: v for k, v in unsupported.items() if v}
  if bad:
    raise CheckpointFormatError(
        f"{source}: DFlash options {bad} are not supported (our block drafter attends"
        " bidirectionally over full context, feeds unscaled embeddings and leaves the target's"
        " logits as they are).")


def options(hf: Mapping[str, Any]) -> tuple[dict[str, Any], Any, Any, Any]:
  """(dflash_config, block_size, mask_token_id, target_layer_ids) wherever the file keeps them."""
  dflash = dict(hf.get("dflash_config") or {})
  block = dflash.get("block_size", hf.get("block_size", _BLOCK_DEFAULT))
  mask_id = dflash.get("mask_token_id", hf.get("mask_token_id"))
  taps = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
  return dflash, block, mask_id, taps


def read_backbone(hf, tensors, target, *, source: str, what: str, min_block: int
                  ) -> tuple[dict[str, Any], dict[str, np.ndarray], common.Tensors]:
  """The DFlash backbone of a DFlash, DSpark or Domino checkpoint.

  Returns:
    (drafter config without kind / block_size, params, the tensors left).
  """
  c = common.layer_config(hf, "qwen3", source=source)
  tc = target.config
  d, nl = c.hidden_size, c.num_layers
  dflash, block, mask_id, taps = options(hf)
  if int(block) < min_block:
    raise CheckpointFormatError(f"{source}: {what} config needs block_size >= {min_block} (the"
                                f" anchor and {min_block - 1} or more masks), got {block!r}.")
  if mask_id is None:
    raise CheckpointFormatError(f"{source}: {what} config has no mask_token_id (top level or in"
                                " dflash_config).")
  if "fc.weight" not in tensors:
    raise ModelLoadError(f"Tensor 'fc.weight' is missing from {source}: the checkpoint is"
                         " incomplete or corrupt.")
  num_taps = max(tensors["fc.weight"].shape[-1] // d, 1)
  taps = [int(x) for x in taps or _dflash_default_taps(num_taps, tc.num_layers)]
  if any(t < 0 for t in taps):
    raise CheckpointFormatError(
        f"{source}: target_layer_ids {taps} tap the input embeddings (-1); our targets expose"
        " decoder-layer outputs only (ids 0 .. L - 1).")
  if tc.num_layers - 1 in taps:
    raise CheckpointFormatError(
        f"{source}: target_layer_ids {taps} tap the target's last layer ({tc.num_layers - 1}),"
        " which the upstream code reads from transformers' hidden_states after the final norm;"
        " our target taps are decoder-layer outputs before it, so this drafter would read other"
        " features than it was trained on.")
  common.check_fc(tensors, taps, d, source=source)
  pairs = common.common_pairs(hf, c, tc)
  if "num_target_layers" in hf:
    pairs.append(("num_target_layers", int(hf["num_target_layers"]), tc.num_layers))
  common.check_fits(pairs, taps, tc, source=source)
  if not 0 <= int(mask_id) < tc.vocab_size:
    raise CheckpointFormatError(f"{source}: mask_token_id {mask_id} is outside the target's"
                                f" vocabulary [0, {tc.vocab_size}).")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise CheckpointFormatError(f"{source}: {what} layers with biases are not supported.")
  _check_dflash_options(hf, dflash, source=source)

  t = common.Tensors(tensors, source=source)
  per_layer = []
  for i in range(nl):
    p = f"layers.{i}."
    w = common.attention(t, p, c, d)
    w.update(attn_norm=t.take(p + "input_layernorm.weight", (d,)),
             mlp_norm=t.take(p + "post_attention_layernorm.weight", (d,)),
             q_norm=t.take(p + "self_attn.q_norm.weight", (c.head_dim,)),
             k_norm=t.take(p + "self_attn.k_norm.weight", (c.head_dim,)))
    per_layer.append(w)
  params = {k: np.stack([w[k] for w in per_layer]) for k in per_layer[0]}
  params.update(fc=t.take("fc.weight", (d, len(taps) * d)).T,
                ctx_norm=t.take("hidden_norm.weight", (d,)),
                final_norm=t.take("norm.weight", (d,)))
  # The mask input is the mask token's row of the target's embedding, as DFlash feeds it.
  config = dict(taps=taps, num_layers=nl, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, intermediate_size=c.intermediate_size, draft_vocab_size=0,
                qk_norm=True, mask_token_id=int(mask_id), **common.drafter_rope(c, tc))
  return config, params, t


def read(hf, tensors, target, *, source):
  """(drafter config, params, model_state, None) of a DFlash checkpoint."""
  config, params, t = read_backbone(hf, tensors, target, source=source, what="DFlash",
                                    min_block=2)
  t.check_empty("block drafter")
  _, block, _, _ = options(hf)
  return dict(config, kind="block", block_size=int(block) - 1), params, {}, None


def backbone_layout(drafter, dtype, *, what: str
                    ) -> tuple[dict[str, Any], dict[str, np.ndarray], int]:
  """(config.json base, backbone tensors, mask_token_id) of a block-family drafter.

  A draft vocabulary (the target's head restricted to the commonest ids,
  `with_draft_vocab`) is left out, with a warning: no weight of the block
  family depends on it (DSpark's and Domino's head rows stay [V, r]), so the
  layout's drafter is the full-vocabulary one, drafting over the whole head.
  """
  s, tc = drafter.spec, drafter.target_config
  if drafter.reduced_vocab:
    warnings.warn(f"The {what} layout has no draft vocabulary: the drafter is written to draft"
                  f" over the target's whole head, not its {s.draft_vocab_size} draft ids"
                  " (its weights do not depend on them).", stacklevel=2)
  if tc.num_layers - 1 in drafter.taps:
    warnings.warn(f"This drafter taps the target's last layer ({tc.num_layers - 1}) before the"
                  f" final norm; the {what} code upstream reads that layer's features after it"
                  " (transformers' last hidden state), so other readers feed it other features.",
                  stacklevel=2)
  if not s.qk_norm:
    raise CheckpointFormatError(f"This drafter has no q/k norms; {what} layers always apply them"
                                " (train it with qk_norm=True).")
  mask_id = s.mask_token_id
  if mask_id is None:
    # A learned mask vector: expressible only when it is a row of the embedding.
    mask = np.asarray(drafter.mask_embed[...])
    embed = np.asarray(drafter.embed[...]).astype(mask.dtype)
    rows = np.flatnonzero((embed == mask[None, :]).all(axis=1))
    if not rows.size:
      raise CheckpointFormatError(
          "This drafter's mask embedding is a learned vector, not a row of the target's"
          f" embedding; the {what} layout stores only a mask_token_id whose embedding is fed"
          " (train the drafter with a mask_token_id).")
    mask_id = int(rows[0])
  w = {k: common.to_np(getattr(drafter, k)[...], dtype)
       for k in ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm", "q_norm",
                 "k_norm", "fc", "ctx_norm", "final_norm")}
  tensors = {"fc.weight": w["fc"].T, "hidden_norm.weight": w["ctx_norm"],
             "norm.weight": w["final_norm"]}
  for i in range(s.num_layers):
    p = f"layers.{i}."
    tensors.update(common.split_layer({k: x[i] for k, x in w.items()}, p, s))
    tensors.update({p + "input_layernorm.weight": w["attn_norm"][i],
                    p + "post_attention_layernorm.weight": w["mlp_norm"][i],
                    p + "self_attn.q_norm.weight": w["q_norm"][i],
                    p + "self_attn.k_norm.weight": w["k_norm"][i]})
  config = common.base_config(tc, s, num_layers=s.num_layers)
  # SpecForge's DFlash reads one attention type per layer (all full attention here).
  config.update(model_type="qwen3", num_target_layers=tc.num_layers,
                layer_types=["full_attention"] * s.num_layers)
  return config, tensors, int(mask_id)


def layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  config, tensors, mask_id = backbone_layout(drafter, dtype, what="DFlash")
  block = drafter.spec.block_size + 1
  dflash = {"mask_token_id": mask_id, "target_layer_ids": list(drafter.taps),
            "block_size": block}
  config.update(architectures=[ARCHITECTURE], block_size=block, dflash_config=dflash)
  return config, tensors
