"""Domino (jianuo-huang/Domino, SpecForge) <-> `DominoDrafter`.

    config   DFlash + architectures ["DominoDraftModel"], emb_dim (correction rank;
             SpecForge reads it in dflash_config, Domino's files at the top level:
             written in both), dflash_config {projector_type "domino",
             pure_draft_prefix_len 1, gru_hidden_dim, shift_label true}
             (absent keys mean 0 / false, as SpecForge reads them)
    weights  the DFlash backbone; prefix_gru.weight_{ih,hh}_l0 [3G, H] / [3G, G]
             (PyTorch gate order r, z, n, no bias); embed_proj.0.weight [r, H + G];
             embed_proj.2.weight [V, r] (older files: under `logit_head.`)

Shifted labels: all B outputs of [anchor, mask x (B - 1)] are drafts (our
gamma is B); the first is a pure backbone draft (pure_draft_prefix_len 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dloop_jax.drafters.hf_format import common
from dloop_jax.drafters.hf_format import dflash
from dloop_jax.errors import CheckpointFormatError

ARCHITECTURE = "DominoDraftModel"
W_IH, W_HH = "prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0"
W1, W2 = "embed_proj.0.weight", "embed_proj.2.weight"
_OLD_PREFIX = "logit_head."


def read(hf, tensors, target, *, source):
  """(drafter config, params, model_state, None) of a Domino checkpoint."""
  options, block, _, _ = dflash.options(hf)
  # Missing keys default as in SpecForge's DominoDraftModel: no pure prefix, unshifted.
  prefix_len = int(options.get("pure_draft_prefix_len", 0))
  shift = bool(options.get("shift_label", False))
  if prefix_len != 1 or not shift:
    raise CheckpointFormatError(
        f"{source}: Domino with pure_draft_prefix_len={prefix_len}, shift_label={shift} is not"
        " supported (ours: shift_label true, pure_draft_prefix_len 1: shifted labels, the first"
        " draft of a block from the backbone alone). A config without these keys means 0 /"
        " false, as SpecForge reads it; set them if the drafter was trained with 1 / true.")
  tensors = {k.removeprefix(_OLD_PREFIX): x for k, x in tensors.items()}
  config, params, t = dflash.read_backbone(hf, tensors, target, source=source, what="Domino",
                                           min_block=1)
  common.check_frozen_copies(t, target, source=source)
  v, d = target.config.vocab_size, target.config.hidden_size
  # Widths from the config, else from the tensors (a missing one is reported by `take`).
  hh, w1 = t.left.get(W_HH), t.left.get(W1)
  g = int(options.get("gru_hidden_dim") or (hh.shape[-1] if hh is not None else 0))
  r = int(options.get("emb_dim") or hf.get("emb_dim")
          or (w1.shape[0] if w1 is not None else 0))
  params.update(gru_w_ih=t.take(W_IH, (3 * g, d)), gru_w_hh=t.take(W_HH, (3 * g, g)),
                correction_w1=t.take(W1, (r, d + g)), correction_w2=t.take(W2, (v, r)))
  t.check_empty("Domino drafter")
  config.update(kind="domino", block_size=int(block), gru_hidden_size=g, correction_rank=r)
  return config, params, {}, None


def layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  config, tensors, mask_id = dflash.backbone_layout(drafter, dtype, what="Domino")
  s = drafter.spec
  tensors.update({W_IH: common.to_np(drafter.gru_w_ih[...], dtype),
                  W_HH: common.to_np(drafter.gru_w_hh[...], dtype),
                  W1: common.to_np(drafter.correction_w1[...], dtype),
                  W2: common.to_np(drafter.correction_w2[...], dtype)})
  options = {"mask_token_id": mask_id, "target_layer_ids": list(drafter.taps),
             "block_size": s.block_size, "projector_type": "domino",
             "pure_draft_prefix_len": 1, "gru_hidden_dim": s.gru_hidden_size,
             "shift_label": True, "emb_dim": s.correction_rank}
  config.update(architectures=[ARCHITECTURE], block_size=s.block_size,
                emb_dim=s.correction_rank, dflash_config=options)
  return config, tensors
