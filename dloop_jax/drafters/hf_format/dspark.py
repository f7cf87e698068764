"""DSpark (deepseek-ai/DeepSpec) <-> `DSparkDrafter`.

    config   Qwen3 + architectures ["Qwen3DSparkModel"], block_size, mask_token_id,
             target_layer_ids, markov_rank, markov_head_type "vanilla",
             enable_confidence_head
    weights  the DFlash backbone; markov_head.markov_w{1,2}.weight [V, r];
             confidence_head.proj.{weight [1, H + r], bias [1]}; frozen copies of
             the target's embed_tokens / lm_head

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
  if confidence:
    params.update(confidence_proj=t.take(PROJ, (1, d + rank)), confidence_bias=t.take(BIAS, (1,)))
  t.check_empty("DSpark drafter")
  _, block, _, _ = dflash.options(hf)
  config.update(kind="dspark", block_size=int(block), markov_rank=rank,
                enable_confidence_head=confidence)
  return config, params, {}, None


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
  config.update(architectures=[ARCHITECTURE], block_size=s.block_size, mask_token_id=mask_id,
                target_layer_ids=list(drafter.taps), markov_rank=s.markov_rank,
                markov_head_type="vanilla", enable_confidence_head=s.enable_confidence_head)
  return config, tensors
