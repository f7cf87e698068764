"""`DrafterSpec`: the static, JSON-able configuration every product drafter is built from."""

from __future__ import annotations

import dataclasses
from typing import Any

from dloop_jax.models.config import RopeScaling

KINDS = ("eagle3", "block", "dspark", "domino")

# Keys only some kinds have: (kind, key) pairs; `to_dict` leaves the others out,
# so the configs of the other kinds (and their exports) are unchanged.
HEAD_KEYS = {
    "dspark": ("markov_rank", "enable_confidence_head"),
    "domino": ("gru_hidden_size", "correction_rank"),
}
# Block-family keys (the drafters built on `BlockDrafter`).
BLOCK_KINDS = ("block", "dspark", "domino")
# Keys `to_dict` writes only away from their defaults (the configs and exports
# of drafters that keep them are those of before the keys), and the kinds they
# apply to.
OPTIONAL_KEYS = {
    "rope_theta": (None, KINDS),
    "rope_scaling": (None, KINDS),
    "norm_output": (True, ("eagle3",)),
    "confidence_head_with_markov": (True, ("dspark",)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSpec:
  """Shape of a drafter (hashable: it is a static attribute of the module).

  Attributes:
    kind: "eagle3", "block", "dspark" or "domino".
    block_size: stage size gamma it is trained for (block: the most it drafts).
    taps: target decoder layers whose outputs it reads.
    num_layers: drafter decoder layers (EAGLE-3: 1).
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention).
    head_dim: per-head width.
    intermediate_size: MLP width.
    draft_vocab_size: reduced draft vocabulary size Vd (0 = the target's).
    qk_norm: per-head RMSNorm on queries and keys (DFlash does this).
    mask_token_id: block family: the mask input is the target's embedding of
      this token (frozen, as in DFlash / DSpark / Domino checkpoints); None =
      a learned mask vector `mask_embed`.
    markov_rank: DSpark: rank r of the Markov head (0 = no Markov head).
    enable_confidence_head: DSpark: learn a per-draft acceptance estimate.
    gru_hidden_size: Domino: width G of the prefix GRU.
    correction_rank: Domino: width r of the correction MLP.
    rope_theta: the drafter's own RoPE base; None = it rotates as the target
      does (theta and scaling: the drafters trained here).
    rope_scaling: the drafter's own Llama-3 scaling (with `rope_theta` set;
      None = no scaling).
    norm_output: EAGLE-3: the LM head reads the final-normed hidden state
      (SpecForge's `norm_output: false` feeds it the raw one).
    confidence_head_with_markov: DSpark: the confidence head also reads the
      Markov head's embedding of the previous token ([1, H + r]; False: [1, H]).
  """

  kind: str
  block_size: int
  taps: tuple[int, ...]
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  draft_vocab_size: int = 0
  qk_norm: bool = False
  mask_token_id: int | None = None
  markov_rank: int = 0
  enable_confidence_head: bool = False
  gru_hidden_size: int = 0
  correction_rank: int = 0
  rope_theta: float | None = None
  rope_scaling: RopeScaling | None = None
  norm_output: bool = True
  confidence_head_with_markov: bool = True

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["taps"] = list(self.taps)
    for kind, keys in HEAD_KEYS.items():
      if kind != self.kind:
        for key in keys:
          del d[key]
    if self.mask_token_id is None:
      del d["mask_token_id"]  # learned mask: the configs (and exports) of before the key
    for key, (default, _) in OPTIONAL_KEYS.items():
      if d[key] == default:
        del d[key]
    if self.rope_scaling is not None:
      d["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
    return d

  @property
  def own_rope(self) -> bool:
    """Whether the drafter rotates with its own settings rather than the target's."""
    return self.rope_theta is not None
