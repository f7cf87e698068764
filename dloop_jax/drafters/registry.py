"""Building drafters from plain configs: `default_drafter_config`, `build_drafter`
(`build_for_loading`: the same, for weights about to be loaded into it).

A drafter config is a flat dict (or ConfigDict):

    kind               "eagle3" | "block" | "dspark" | "domino"
    block_size         gamma: drafts per stage (block: the most one forward drafts)
    taps               target decoder layers read (default: low / middle / high)
    num_layers         decoder layers (EAGLE-3: 1)
    num_heads, num_kv_heads, head_dim, intermediate_size
                       layer shape (default: the target's)
    draft_vocab_size   reduced draft vocabulary (0 = the target's); EAGLE-3 by default
                       on large vocabularies
    qk_norm            per-head RMSNorm of q and k (default: on for block, dspark, domino)
    mask_token_id      block, dspark, domino: the mask input is the target's (frozen)
                       embedding of this token, as in DFlash checkpoints (default None:
                       a learned mask vector)
    markov_rank        dspark: rank of the Markov head (0 = none; default 256, at most
                       the hidden size)
    enable_confidence_head
                       dspark: learn per-draft acceptance estimates (default on)
    gru_hidden_size    domino: prefix GRU width (default: a quarter of the hidden size, as
                       Domino's 1024 for 4096-wide targets)
    correction_rank    domino: correction MLP width (default 256, at most the hidden size)
    rope_theta, rope_scaling
                       the drafter's own RoPE (theta, Llama-3 scaling dict or None);
                       default: none of its own, it rotates as the target does
    norm_output        eagle3: the LM head reads the final-normed state (default True)
    confidence_head_with_markov
                       dspark: the confidence head also reads the Markov embedding of
                       the previous token (default True)

dspark and domino are trained over the full vocabulary (their heads' output
weights are [V, r]); `with_draft_vocab` restricts a trained one afterwards.

`Drafter.drafter_config()` returns the resolved dict (every key), which rebuilds
the same drafter.

Sizing for the default target (SmolLM2-135M: 30 layers, D 576, 9 / 3 heads of
64, MLP 1536, vocab 49152; ~134M weights read per token, LM head included):

  EAGLE-3, draft vocab 8192: fc 1.0M (commit only), layer 4.1M, head 4.7M:
    ~8.8M weights per drafting step, ~6.6 % of a target forward; a stage of
    gamma = 4 reads ~26 %, 3 steps (the first draft of a round costs only the head).
  block, 3 layers: 10.6M weights plus the frozen 28M head over gamma mask
    positions, once per stage: ~29 % of a target forward in weights read, for
    a whole block of 8 drafts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from dloop_jax import mesh as mesh_lib
from dloop_jax.drafters import variables as variables_lib
from dloop_jax.drafters import vocab as vocab_lib
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.drafters.block import BlockDrafter
from dloop_jax.drafters.eagle3 import Eagle3Drafter
from dloop_jax.drafters.domino import DominoDrafter
from dloop_jax.drafters.dspark import DSparkDrafter
from dloop_jax.drafters.spec import BLOCK_KINDS, HEAD_KEYS, KINDS, OPTIONAL_KEYS, DrafterSpec
from dloop_jax.errors import ConfigError
from dloop_jax.models import rope as rope_lib
from dloop_jax.models.config import RopeScaling, TransformerConfig, default_taps

# EAGLE-3 reduces vocabularies above this size to it (Llama-3: 128k -> 32k).
DEFAULT_DRAFT_VOCAB = 8192
_KEYS = ("kind", "block_size", "taps", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "intermediate_size", "draft_vocab_size", "qk_norm", "mask_token_id") + tuple(
             k for keys in HEAD_KEYS.values() for k in keys) + tuple(OPTIONAL_KEYS)
# DSpark ships block 7 and r = 256 (DeepSpec); Domino r = 256 (its paper).
HEAD_RANK = 256


def default_drafter_config(kind: str, target_config: TransformerConfig) -> dict[str, Any]:
  """The default drafter of `kind` for a target (every key of the config)."""
  c = target_config
  common = dict(taps=list(default_taps(c.num_layers)), num_heads=c.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                intermediate_size=c.intermediate_size)
  if kind == "eagle3":
    vd = DEFAULT_DRAFT_VOCAB if c.vocab_size > DEFAULT_DRAFT_VOCAB else 0
    return dict(kind="eagle3", block_size=4, num_layers=1, draft_vocab_size=vd, qk_norm=False,
                **common)
  # DFlash uses a handful of layers for 36-layer targets: ~1 per 10 target layers.
  layers = max(1, min(5, c.num_layers // 10))
  if kind == "block":
    return dict(kind="block", block_size=8, num_layers=layers, draft_vocab_size=0, qk_norm=True,
                **common)
  rank = min(HEAD_RANK, c.hidden_size)
  if kind == "dspark":
    return dict(kind="dspark", block_size=7, num_layers=layers, draft_vocab_size=0, qk_norm=True,
                markov_rank=rank, enable_confidence_head=True, **common)
  if kind == "domino":
    return dict(kind="domino", block_size=8, num_layers=layers, draft_vocab_size=0, qk_norm=True,
                gru_hidden_size=max(1, c.hidden_size // 4), correction_rank=rank, **common)
  raise ConfigError(f"Unknown drafter kind {kind!r}; expected one of {KINDS}.")


def _plain(config: Any) -> dict[str, Any]:
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise ConfigError(f"A drafter config is a dict, got {type(config).__name__}.")
  return dict(config)


def resolve_config(config: Mapping[str, Any] | Any, target_config: TransformerConfig) -> DrafterSpec:
  """Fills defaults and validates a drafter config."""
  given = _plain(config)
  kind = given.get("kind")
  if kind not in KINDS:
    raise ConfigError(f"Drafter config needs kind in {KINDS}, got {kind!r}.")
  foreign = sorted(k for other, keys in HEAD_KEYS.items() if other != kind for k in keys
                   if k in given)
  foreign += sorted(k for k, (default, kinds) in OPTIONAL_KEYS.items()
                    if kind not in kinds and given.get(k, default) != default)
  if foreign:
    raise ConfigError(f"Drafter config keys {foreign} do not apply to kind {kind!r}.")
  unknown = sorted(set(given) - set(_KEYS))
  if unknown:
    hints = [difflib.get_close_matches(k, _KEYS, n=1) for k in unknown]
    hint = "".join(f"; did you mean {h[0]!r} for {k!r}?" for k, h in zip(unknown, hints) if h)
    raise ConfigError(f"Unknown drafter config keys {unknown}{hint} Known: {list(_KEYS)}.")
  merged = default_drafter_config(kind, target_config)
  merged.update({k: v for k, v in given.items() if v is not None})
  taps = tuple(int(t) for t in merged["taps"])
  bad = [t for t in taps if not 0 <= t < target_config.num_layers]
  if not taps or bad:
    raise ConfigError(f"taps must be non-empty target layer indices in [0,"
                      f" {target_config.num_layers}); got {list(taps)}.")
  for key in ("block_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size"):
    value = merged[key]
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"Drafter config {key} must be an int >= 1, got {value!r}.")
  vd = merged["draft_vocab_size"]
  if not isinstance(vd, (int, np.integer)) or not 0 <= vd <= target_config.vocab_size:
    raise ConfigError(f"draft_vocab_size must be an int in [0, {target_config.vocab_size}]"
                      f" (0 = the target's vocabulary), got {vd!r}.")
  if merged["num_heads"] % merged["num_kv_heads"]:
    raise ConfigError(f"num_heads ({merged['num_heads']}) must be a multiple of num_kv_heads"
                      f" ({merged['num_kv_heads']}).")
  if merged["head_dim"] % 2:
    raise ConfigError(f"head_dim must be even (RoPE), got {merged['head_dim']}.")
  if kind == "eagle3" and merged["num_layers"] != 1:
    raise ConfigError(f"An EAGLE-3 drafter has one decoder layer; got num_layers="
                      f"{merged['num_layers']}.")
  mask_id = merged.get("mask_token_id")
  if mask_id is not None:
    if kind not in BLOCK_KINDS:
      raise ConfigError(f"mask_token_id applies to the block family {BLOCK_KINDS}, not to"
                        f" kind {kind!r}; leave it out.")
    if (not isinstance(mask_id, (int, np.integer)) or isinstance(mask_id, bool)
        or not 0 <= mask_id < target_config.vocab_size):
      raise ConfigError(f"mask_token_id must be a token id in [0, {target_config.vocab_size})"
                        f" (or None: a learned mask vector), got {mask_id!r}.")
    mask_id = int(mask_id)
  heads = {}
  if kind in HEAD_KEYS:
    keys = dict(markov_rank=0, gru_hidden_size=1, correction_rank=1)
    for key in HEAD_KEYS[kind]:
      if key in keys:
        value = merged[key]
        if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
            or value < keys[key]):
          raise ConfigError(f"Drafter config {key} must be an int >= {keys[key]}, got"
                            f" {value!r}.")
        heads[key] = int(value)
      else:
        heads[key] = bool(merged[key])
  return DrafterSpec(
      kind=kind, block_size=int(merged["block_size"]), taps=taps, **_optional(given),
      num_layers=int(merged["num_layers"]), num_heads=int(merged["num_heads"]),
      num_kv_heads=int(merged["num_kv_heads"]), head_dim=int(merged["head_dim"]),
      intermediate_size=int(merged["intermediate_size"]), draft_vocab_size=int(vd),
      qk_norm=bool(merged["qk_norm"]), mask_token_id=mask_id, **heads)


def _optional(given: Mapping[str, Any]) -> dict[str, Any]:
  """The `OPTIONAL_KEYS` of a config, validated (absent: their defaults)."""
  out = {k: given.get(k, default) for k, (default, _) in OPTIONAL_KEYS.items()}
  for key in ("norm_output", "confidence_head_with_markov"):
    out[key] = bool(out[key])
  theta, scaling = out["rope_theta"], out["rope_scaling"]
  if theta is None:
    if scaling is not None:
      raise ConfigError("rope_scaling needs rope_theta: a drafter with its own RoPE states both"
                        " (rope_theta None means the target's RoPE, scaling included).")
    return out
  if isinstance(theta, bool) or not isinstance(theta, (int, float, np.number)) or theta <= 1:
    raise ConfigError(f"rope_theta must be a number > 1 (or None: the target's RoPE), got"
                      f" {theta!r}.")
  out["rope_theta"] = float(theta)
  if scaling is not None and not isinstance(scaling, RopeScaling):
    if not isinstance(scaling, Mapping):
      raise ConfigError(f"rope_scaling must be a dict (config.json's) or None, got {scaling!r}.")
    scaling = rope_lib.scaling_from_dict(scaling)
  out["rope_scaling"] = scaling
  return out


def build_drafter(config: Mapping[str, Any] | Any, *, target, rngs: nnx.Rngs,
                  token_counts: np.ndarray | None = None) -> Drafter:
  """Builds the drafter a config describes, for `target`.

  Args:
    config: drafter config (dict or ConfigDict), see the module docstring;
      missing keys take `default_drafter_config` values.
    target: the target `Transformer` (its embedding / head are shared, frozen).
    rngs: RNG streams of the initialisation.
    token_counts: optional [V] counts of the training tokens: a reduced draft
      vocabulary is then their most frequent ids (else the first ids, until
      `set_draft_vocab` is called).

  Returns:
    An `Eagle3Drafter`, `BlockDrafter`, `DSparkDrafter` or `DominoDrafter`.
  """
  spec = resolve_config(config, target.config)
  cls = {"eagle3": Eagle3Drafter, "block": BlockDrafter, "dspark": DSparkDrafter,
         "domino": DominoDrafter}[spec.kind]
  drafter = cls(spec, target=target, rngs=rngs)
  if token_counts is not None and drafter.reduced_vocab:
    d2t, _ = vocab_lib.draft_vocab_from_counts(token_counts, spec.draft_vocab_size)
    drafter.set_draft_vocab(d2t, target=target)
  return drafter


def build_for_loading(config: Mapping[str, Any], *, target: Any,
                      rngs: nnx.Rngs | None = None) -> Drafter:
  """The drafter `config` describes, built for `target` (its weights about to be overwritten)."""
  # Drafters may annotate weights with logical axes; flax then needs a mesh in
  # scope to create them. One device here: callers shard the loaded drafter.
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  with mesh_lib.mesh_context(mesh, mesh_lib.DEFAULT_RULES):
    return build_drafter(dict(config), target=target,
                         rngs=rngs if rngs is not None else nnx.Rngs(0))


def with_draft_vocab(drafter: Drafter, token_counts: np.ndarray, *, size: int,
                     target) -> Drafter:
  """`drafter`, drafting only the `size` most frequent ids of `token_counts`.

  For drafters whose head is the target's own (frozen) head, as the block
  family's (block, DSpark, Domino): the trained weights are kept, and the
  draft logits over the kept ids are unchanged, so a draft changes only where
  the drafter's best token falls outside them (which the target would rarely
  accept: they are the rarest tokens of the data). A drafting stage then
  reads `size` head rows instead of the whole vocabulary's (SmolLM2: 16,384 of
  49,152); DSpark's Markov head and Domino's correction read the same rows of
  their [V, r] output weights (`markov_w2`, `correction_w2`), and their heads
  are fed the drafts as target ids.

  Args:
    drafter: a drafter over the full vocabulary (draft_vocab_size 0); DSpark
      and Domino drafters train only that way and are restricted here.
    token_counts: [V] counts of the tokens the drafter predicts (its training
      data's responses: `dloop_jax.data.pipeline.token_counts`).
    size: the draft vocabulary's size, 0 < size < V.
    target: the target `Transformer` the drafter belongs to.

  Raises:
    ConfigError: the drafter already has a draft vocabulary, its weights
      depend on the vocabulary (e.g. an EAGLE-3 head: train it with a
      draft_vocab_size instead), or a bad size / counts shape.
  """
  config = variables_lib.drafter_config_of(drafter)
  vocab_size = int(target.config.vocab_size)
  if int(config.get("draft_vocab_size") or 0):
    raise ConfigError(f"The drafter already drafts over a vocabulary of"
                      f" {config['draft_vocab_size']} ids; restrict a full-vocabulary one.")
  if not 0 < size < vocab_size:
    raise ConfigError(f"A draft vocabulary size must be in (0, {vocab_size}), got {size}.")
  token_counts = np.asarray(token_counts)
  if token_counts.shape != (vocab_size,):
    raise ConfigError(f"token_counts must have shape ({vocab_size},), got {token_counts.shape}.")
  # The most frequent ids as the draft vocabulary (build_drafter), then the
  # trained weights (the maps are no parameters: they stay).
  restricted = build_drafter(dict(config, draft_vocab_size=int(size)), target=target,
                             rngs=nnx.Rngs(0), token_counts=token_counts)

  def layout(d):
    return {path: v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(d, nnx.Param))}

  if layout(restricted) != layout(drafter):
    raise ConfigError(f"The {config.get('kind')} drafter's weights depend on its vocabulary"
                      " (its own head); train it with a draft_vocab_size instead.")
  nnx.update(restricted, nnx.state(drafter, nnx.Param))
  return restricted
