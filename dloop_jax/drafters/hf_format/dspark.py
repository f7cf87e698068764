"""DSpark (deepseek-ai/DeepSpec) <-> `DSparkDrafter`.

    config   Qwen3 + architectures ["Qwen3DSparkModel"], block_size, mask_token_id,
             target_layer_ids, markov_rank, markov_head_type "vanilla",
             enable_confidence_head, confidence_head_with_markov, num_anchors,
             layer_types
    weights  the DFlash backbone; markov_head.markov_w{1,2}.weight [V, r];
             confidence_head.proj.{weight [1, H + r] (with Markov) or [1, H],
             bias [1]}; frozen copies of the target's embed_tokens / lm_head

Shifted labels: the block is [anchor, mask x (B - 1)] and all B outputs are
drafts, so our stage size gamma is B (DFlash's is B - 1). The frozen copies
must be the target's (checked, not loaded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dloop_jax.drafters.hf_format import common
from dloop_jax.drafters.hf_format import dflash
from dloop_jax.errors import CheckpointFormatError

ARCHITECTURE = "Qwen3DSparkModel"
NUM_ANCHORS = 512
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
PROJ, BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"


def read(hf, tensors, target, *, source):
  """(drafter config, params, model_state, None) of a DSpark checkpoint."""
  head_type = hf.get("markov_head_type", "vanilla")
  rank = int(hf.get("markov_rank") or 0)
  if rank and head_type != "vanilla":
    raise CheckpointFormatError(f"{source}: markov_head_type={head_type!r} is not supported (only"
                                " 'vanilla': logits + W2 W1[previous token]).")
  config, params, t = dflash.read_backbone(hf, tensors, target, source=source, what="DSpark",
                                           min_block=1)
  common.check_frozen_copies(t, target, source=source)
  v, d = target.config.vocab_size, target.config.hidden_size
  confidence = bool(hf.get("enable_confidence_head", False))
  if rank:
    params.update(markov_w1=t.take(W1, (v, rank)), markov_w2=t.take(W2, (v, rank)))
  with_markov = False
  if confidence:
    with_markov = _confidence_with_markov(hf, t.left.get(PROJ), d=d, rank=rank, source=source)
    params.update(confidence_proj=t.take(PROJ, (1, d + (rank if with_markov else 0))),
                  confidence_bias=t.take(BIAS, (1,)))
  t.check_empty("DSpark drafter")
  _, block, _, _ = dflash.options(hf)
  config.update(kind="dspark", block_size=int(block), markov_rank=rank,
                enable_confidence_head=confidence)
  if confidence and rank and not with_markov:
    config["confidence_head_with_markov"] = False
  return config, params, {}, None


def _confidence_with_markov(hf, proj, *, d: int, rank: int, source: str) -> bool:
  """Whether the confidence head reads the Markov embedding too ([1, H + r], else [1, H]).

  DeepSpec's config states it (`confidence_head_with_markov`); files without
  the key (written before it) say it by the projection's width.
  """
  if "confidence_head_with_markov" in hf:
    with_markov = bool(hf["confidence_head_with_markov"])
    if with_markov and not rank:
      raise CheckpointFormatError(f"{source}: confidence_head_with_markov is true but there is"
                                  " no Markov head (markov_rank 0).")
    return with_markov
  return bool(rank) and proj is not None and proj.ndim == 2 and proj.shape[-1] == d + rank


def layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  config, tensors, mask_id = dflash.backbone_layout(drafter, dtype, what="DSpark")
  s = drafter.spec
  tensors.update(common.frozen_copies(drafter, dtype))
  if s.markov_rank:
    tensors.update({W1: common.to_np(drafter.markov_w1[...], dtype),
                    W2: common.to_np(drafter.markov_w2[...], dtype)})
  if s.enable_confidence_head:
    tensors.update({PROJ: common.to_np(drafter.confidence_proj[...], dtype),
                    BIAS: common.to_np(drafter.confidence_bias[...], dtype)})
  # Every field DeepSpec's model asserts is present (num_anchors is its training-time anchor
  # count per sequence, unused at inference; 512 as its configs and SpecForge's default).
  config.update(architectures=[ARCHITECTURE], block_size=s.block_size, mask_token_id=mask_id,
                target_layer_ids=list(drafter.taps), markov_rank=s.markov_rank,
                markov_head_type="vanilla", enable_confidence_head=s.enable_confidence_head,
                num_anchors=NUM_ANCHORS)
  if s.enable_confidence_head:
    config["confidence_head_with_markov"] = bool(s.markov_rank
                                                 and s.confidence_head_with_markov)
  return config, tensors
