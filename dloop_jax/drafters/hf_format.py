"""Public drafter checkpoints in Hugging Face layouts: EAGLE-3 and DFlash.

A directory with `config.json` and `model.safetensors` (or `pytorch_model.bin`)
as SafeAILab/EAGLE, SpecForge and z-lab/dflash write them, read into our
drafters and written from them (so SGLang / vLLM can serve ours):

    EAGLE-3   config: Llama, num_hidden_layers 1, draft_vocab_size,
              eagle_config.eagle_aux_hidden_state_layer_ids (taps)
              weights: fc, midlayer.* (or layers.0.*), norm, lm_head, d2t, t2d
              -> `Eagle3Drafter`
    DFlash    config: architectures ["DFlashDraftModel"], block_size,
              dflash_config {mask_token_id, target_layer_ids}
              weights: fc, hidden_norm, layers.{i}.*, norm
              -> `BlockDrafter` (drafts block_size - 1 tokens per stage)

Conventions mapped on the way:
  * PyTorch matrices are [out, in]; ours are [in, out]. q/k/v and gate/up are
    fused into our `wqkv` / `w_gate_up` (columns in that order).
  * EAGLE-3's `d2t` holds offsets (target_id = draft_id + d2t[draft_id]) and
    `t2d` a [V] bool mask; ours hold the target ids and draft ids (-1 outside).
  * A tap is the output of a 0-based decoder layer in both (EAGLE-3's default
    taps are `default_taps`, DFlash's `round(1 + i (L - 4) / (n - 1))`).
  * DFlash's block is [anchor, mask x (B - 1)] with the mask token embedded by
    the target's embedding: our learned `mask_embed` takes that row, and our
    stage size gamma is B - 1 (each output predicts the token at its own
    position in both).

Our drafters take the target's RoPE (theta, scaling) and RMSNorm epsilon, so a
checkpoint must agree with the target on those; EAGLE-3 variants with q/k
norms or biases (DeepSpec's, `attention_bias`) and Domino / DSpark (shifted
labels, extra heads) are refused with `CheckpointFormatError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax.drafters import io as io_lib
from dloop_jax.drafters.base import Frozen
from dloop_jax.errors import CheckpointFormatError, DrafterMismatchError, ModelLoadError
from dloop_jax.models import hf_loader
from dloop_jax.models.config import TransformerConfig, default_taps

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
DFLASH_ARCHITECTURE = "DFlashDraftModel"
# Our own metadata in an exported config.json (ignored by other readers).
META_KEY = "dloop_jax"
_DEFAULT_EAGLE3_BLOCK = 4

# Public layouts we recognise but cannot represent, and why.
_UNSUPPORTED = {
    "DominoDraftModel": "Domino drafts with shifted labels and a GRU prefix head",
    "Qwen3DSparkModel": "DSpark drafts with shifted labels and Markov / confidence heads",
    "Qwen3Eagle3Model": "DeepSpec's EAGLE-3 has q/k norms, 5 taps and its own embedding layout",
    "DFlash2DraftModel": "DFlash-2 adds dynamic convolutions and a candidate selector",
}
_DFLASH_BLOCK_DEFAULT = 16  # z-lab's default when config.json has no block_size


def is_hf_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a Hugging Face drafter directory (not one of our exports)."""
  p = os.fspath(path)
  return (os.path.isfile(os.path.join(p, CONFIG_FILE))
          and not os.path.isfile(os.path.join(p, io_lib.INFO_FILE)))


def detect_kind(hf: Mapping[str, Any], *, source: str = "config.json") -> str:
  """The layout ("eagle3" or "dflash") a drafter's `config.json` describes.

  Raises:
    CheckpointFormatError: an unknown or unsupported layout.
  """
  archs = list(hf.get("architectures") or [])
  for arch in archs:
    if arch in _UNSUPPORTED:
      raise CheckpointFormatError(
          f"{source}: architecture {arch!r} is not supported ({_UNSUPPORTED[arch]}, which our"
          " drafters cannot represent). Supported: EAGLE-3 and DFlash drafters.")
  dflash = dict(hf.get("dflash_config") or {})
  if dflash.get("projector_type") not in (None, "dflash") or dflash.get("shift_label"):
    raise CheckpointFormatError(
        f"{source}: a DFlash variant with projector_type={dflash.get('projector_type')!r},"
        f" shift_label={dflash.get('shift_label')!r} is not supported (only unshifted DFlash"
        " blocks map onto our block drafter).")
  if DFLASH_ARCHITECTURE in archs or dflash or (
      not archs and "block_size" in hf and "mask_token_id" in hf):
    return "dflash"
  eagle_hints = "draft_vocab_size" in hf or "eagle_config" in hf
  if any(a in EAGLE3_ARCHITECTURES[:2] for a in archs) or (
      eagle_hints and (not archs or "LlamaForCausalLM" in archs)):
    return "eagle3"
  raise CheckpointFormatError(
      f"{source} describes no drafter we can read (architectures={archs!r}"
      + (", it looks like a target model" if archs and not eagle_hints else "")
      + "). Supported: EAGLE-3 (architectures " + ", ".join(EAGLE3_ARCHITECTURES)
      + " with draft_vocab_size or eagle_config) and DFlash ("
      + f"{DFLASH_ARCHITECTURE!r}).")


# ------------------------------------------------------------------ reading
def _torch_files(path: str) -> list[str]:
  """pytorch_model.bin, or the shards its index lists."""
  index_path = os.path.join(path, TORCH_FILE + ".index.json")
  if not os.path.isfile(index_path):
    return [os.path.join(path, TORCH_FILE)]
  try:
    with open(index_path) as f:
      names = dict.fromkeys(json.load(f)["weight_map"].values())
  except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise ModelLoadError(f"{index_path!r} is not a valid weight index ({e}).") from e
  files = [os.path.join(path, n) for n in names]
  missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
  if missing:
    raise ModelLoadError(f"Shards listed in {index_path!r} are missing: {missing}.")
  return files


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint, by name (safetensors first, then pytorch_model.bin)."""
  has_safetensors = (os.path.isfile(os.path.join(path, SAFETENSORS_FILE))
                     or os.path.isfile(os.path.join(path, SAFETENSORS_FILE + ".index.json")))
  has_torch = any(os.path.isfile(os.path.join(path, TORCH_FILE + tail))
                  for tail in ("", ".index.json"))
  if has_safetensors or not has_torch:
    files = hf_loader._weight_files(path)  # pylint: disable=protected-access
    return dict(hf_loader._iter_tensors(files))  # pylint: disable=protected-access
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ModelLoadError(
        f"{path} holds PyTorch pickles ({TORCH_FILE}) and torch is not installed: install torch,"
        " or convert them to model.safetensors.") from e
  out = {}
  for file in _torch_files(path):
    try:
      # weights_only: tensors and containers only, never arbitrary pickled code.
      state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pylint: disable=broad-except
      first = str(e).splitlines()[0][:300] if str(e) else ""
      raise ModelLoadError(f"Could not read {file} ({type(e).__name__}: {first}); it is"
                           " truncated or corrupt. Re-download it.") from e
    if not isinstance(state, Mapping):
      raise ModelLoadError(f"{file} holds a {type(state).__name__}, not a state dict.")
    for name, t in state.items():
      # numpy has no bfloat16: widen it (exactly) before leaving torch.
      out[name] = (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
  return out


class _Tensors:
  """Takes named tensors out of a checkpoint, checking shapes; reports what is left."""

  def __init__(self, tensors: Mapping[str, np.ndarray], *, source: str):
    self.left = dict(tensors)
    self.source = source

  def has(self, name: str) -> bool:
    return name in self.left

  def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.left:
      raise ModelLoadError(f"Tensor {name!r} is missing from {self.source}: the checkpoint is"
                           " incomplete or corrupt.")
    value = self.left.pop(name)
    if tuple(value.shape) != tuple(shape):
      raise ModelLoadError(f"Tensor {name!r} in {self.source} has shape {tuple(value.shape)};"
                           f" config.json implies {tuple(shape)}.")
    return value

  def check_empty(self, what: str) -> None:
    left = sorted(n for n in self.left if not n.endswith("rotary_emb.inv_freq"))
    if left:
      raise CheckpointFormatError(
          f"{self.source} holds tensors our {what} has no place for: {left[:8]}"
          f"{' ...' if len(left) > 8 else ''} (e.g. biases or q/k norms of a variant layout).")


def _layer_config(hf: Mapping[str, Any], family: str, *, source: str) -> TransformerConfig:
  """Shapes, RoPE and epsilon of a drafter's config.json, parsed as the target's are."""
  plain = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
  plain["model_type"] = family
  plain.setdefault("rms_norm_eps", 1e-6)
  try:
    return TransformerConfig.from_hf_config(plain, name=os.path.basename(source))
  except KeyError as e:
    raise ModelLoadError(f"{source}/config.json lacks {e.args[0]!r}.") from e


def _check_fits(pairs: list[tuple[str, Any, Any]], taps: list[int], target: TransformerConfig,
                *, source: str) -> None:
  """Raises DrafterMismatchError naming every field where checkpoint and target differ."""
  diffs = [f"{field}: checkpoint has {mine!r}, target has {theirs!r}"
           for field, mine, theirs in pairs if mine != theirs]
  bad = [t for t in taps if not 0 <= t < target.num_layers]
  if bad:
    diffs.append(f"tapped layers {bad} do not exist in a {target.num_layers}-layer target")
  if diffs:
    raise DrafterMismatchError(
        f"Drafter {source} does not fit target {target.name or ''!r}: " + "; ".join(diffs)
        + ". Use a drafter trained for this target.")


def _common_pairs(hf: Mapping[str, Any], c: TransformerConfig,
                  target: TransformerConfig) -> list[tuple[str, Any, Any]]:
  """(field, checkpoint, target) pairs that must agree for every layout."""
  pairs = [("hidden_size", c.hidden_size, target.hidden_size),
           ("vocab_size", c.vocab_size, target.vocab_size),
           ("rope_theta", c.rope_theta, target.rope_theta),
           ("rope_scaling", c.rope_scaling, target.rope_scaling),
           ("rms_norm_eps", c.rms_norm_eps, target.rms_norm_eps)]
  # Our own exports also record the target's depth, which the layouts do not.
  mine = dict((hf.get(META_KEY) or {}).get("target_fingerprint") or {})
  if "num_layers" in mine:
    pairs.append(("target num_layers", mine["num_layers"], target.num_layers))
  return pairs


def _check_fc(tensors: Mapping[str, np.ndarray], taps: list[int], d: int, *, source: str) -> None:
  """fc must read one hidden state per tap: say so rather than report a bare shape."""
  fc = tensors.get("fc.weight")
  if fc is not None and fc.ndim == 2 and fc.shape[0] == d and fc.shape[1] != len(taps) * d:
    raise CheckpointFormatError(
        f"{source}: fc.weight reads {fc.shape[1] / d:g} hidden states of width {d}, but the"
        f" config's taps are {taps} ({len(taps)}); set the tapped layer ids in config.json.")


def _attention(t: _Tensors, prefix: str, c: TransformerConfig,
               in_dim: int) -> dict[str, np.ndarray]:
  """q/k/v/o and MLP of one layer, in our fused [in, out] layout."""
  q, kv, d, f = c.q_size, c.kv_size, c.hidden_size, c.intermediate_size
  a, m = prefix + "self_attn.", prefix + "mlp."
  return {
      "wqkv": np.concatenate([t.take(a + "q_proj.weight", (q, in_dim)).T,
                              t.take(a + "k_proj.weight", (kv, in_dim)).T,
                              t.take(a + "v_proj.weight", (kv, in_dim)).T], axis=1),
      "wo": t.take(a + "o_proj.weight", (d, q)).T,
      "w_gate_up": np.concatenate([t.take(m + "gate_proj.weight", (f, d)).T,
                                   t.take(m + "up_proj.weight", (f, d)).T], axis=1),
      "w_down": t.take(m + "down_proj.weight", (d, f)).T,
  }


def _read_eagle3(hf, tensors, target, *, source):
  """(drafter config, params, model_state, embedding or None) of an EAGLE-3 checkpoint."""
  c = _layer_config(hf, "llama", source=source)
  tc = target.config
  d, v = c.hidden_size, c.vocab_size
  vd = int(hf.get("draft_vocab_size") or v)
  if int(hf.get("num_hidden_layers", 1)) != 1:
    raise CheckpointFormatError(f"{source}: an EAGLE-3 drafter has one decoder layer; config.json"
                                f" says num_hidden_layers={hf['num_hidden_layers']}.")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise CheckpointFormatError(f"{source}: EAGLE-3 layers with biases are not supported.")
  eagle = dict(hf.get("eagle_config") or {})
  taps = [int(x) for x in eagle.get("eagle_aux_hidden_state_layer_ids")
          or default_taps(tc.num_layers)]
  _check_fits(_common_pairs(hf, c, tc) + [
      ("target_hidden_size", int(hf.get("target_hidden_size") or d), tc.hidden_size)],
              taps, tc, source=source)
  if not 0 < vd <= v:
    raise CheckpointFormatError(f"{source}: draft_vocab_size={vd} is not in [1, vocab_size={v}].")

  # vLLM renames `midlayer.` to `layers.0.`; some exports nest under `model.`.
  tensors = {k.removeprefix("model."): x for k, x in tensors.items()}
  _check_fc(tensors, taps, d, source=source)
  prefix = "layers.0." if any(k.startswith("layers.0.") for k in tensors) else "midlayer."
  t = _Tensors(tensors, source=source)
  params = _attention(t, prefix, c, 2 * d)
  params.update(
      fc=t.take("fc.weight", (d, len(taps) * d)).T,
      input_norm=t.take(prefix + "input_layernorm.weight", (d,)),
      hidden_norm=t.take(prefix + "hidden_norm.weight", (d,)),
      mlp_norm=t.take(prefix + "post_attention_layernorm.weight", (d,)),
      final_norm=t.take("norm.weight", (d,)),
      lm_head=t.take("lm_head.weight", (vd, d)).T,
  )
  embed = t.take("embed_tokens.weight", (v, d)) if t.has("embed_tokens.weight") else None
  model_state = {}
  offsets = t.take("d2t", (vd,)).astype(np.int64) if t.has("d2t") else None
  used = t.take("t2d", (v,)).astype(bool) if t.has("t2d") else None
  if vd < v:
    if offsets is None:
      raise ModelLoadError(f"{source}: draft_vocab_size {vd} < vocab_size {v} but tensor 'd2t'"
                           " (the draft -> target map) is missing.")
    d2t = np.arange(vd, dtype=np.int64) + offsets
    if d2t.min() < 0 or d2t.max() >= v or np.unique(d2t).size != vd:
      raise ModelLoadError(f"{source}: tensor 'd2t' does not map the {vd} draft ids onto distinct"
                           f" target ids in [0, {v}): it is corrupt.")
    if used is not None and (int(used.sum()) != vd or not used[d2t].all()):
      raise ModelLoadError(f"{source}: tensors 'd2t' and 't2d' disagree on the draft vocabulary.")
    t2d = np.full((v,), -1, np.int32)
    t2d[d2t] = np.arange(vd, dtype=np.int32)
    model_state = {"d2t": d2t.astype(np.int32), "t2d": t2d}
  elif offsets is not None and offsets.any():
    raise CheckpointFormatError(f"{source}: the draft vocabulary is the whole vocabulary but"
                                " 'd2t' permutes it; our drafters keep target order then.")
  t.check_empty("EAGLE-3 drafter")
  meta = dict(hf.get(META_KEY) or {})
  config = dict(kind="eagle3", block_size=int(meta.get("block_size", _DEFAULT_EAGLE3_BLOCK)),
                taps=taps, num_layers=1, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                draft_vocab_size=vd if vd < v else 0, qk_norm=False)
  return config, params, model_state, embed


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


def _read_dflash(hf, tensors, target, *, source):
  """(drafter config, params, model_state, None) of a DFlash checkpoint."""
  c = _layer_config(hf, "qwen3", source=source)
  tc = target.config
  d, nl = c.hidden_size, c.num_layers
  dflash = dict(hf.get("dflash_config") or {})
  block = dflash.get("block_size", hf.get("block_size", _DFLASH_BLOCK_DEFAULT))
  if int(block) < 2:
    raise CheckpointFormatError(f"{source}: DFlash config needs block_size >= 2 (the anchor and"
                                f" at least one mask), got {block!r}.")
  mask_id = dflash.get("mask_token_id", hf.get("mask_token_id"))
  if mask_id is None:
    raise CheckpointFormatError(f"{source}: DFlash config has no dflash_config.mask_token_id.")
  if "fc.weight" not in tensors:
    raise ModelLoadError(f"Tensor 'fc.weight' is missing from {source}: the checkpoint is"
                         " incomplete or corrupt.")
  num_taps = max(tensors["fc.weight"].shape[-1] // d, 1)
  taps = [int(x) for x in dflash.get("target_layer_ids")
          or _dflash_default_taps(num_taps, tc.num_layers)]
  _check_fc(tensors, taps, d, source=source)
  pairs = _common_pairs(hf, c, tc)
  if "num_target_layers" in hf:
    pairs.append(("num_target_layers", int(hf["num_target_layers"]), tc.num_layers))
  _check_fits(pairs, taps, tc, source=source)
  if not 0 <= int(mask_id) < tc.vocab_size:
    raise CheckpointFormatError(f"{source}: mask_token_id {mask_id} is outside the target's"
                                f" vocabulary [0, {tc.vocab_size}).")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise CheckpointFormatError(f"{source}: DFlash layers with biases are not supported.")
  _check_dflash_options(hf, dflash, source=source)

  t = _Tensors(tensors, source=source)
  per_layer = []
  for i in range(nl):
    p = f"layers.{i}."
    w = _attention(t, p, c, d)
    w.update(attn_norm=t.take(p + "input_layernorm.weight", (d,)),
             mlp_norm=t.take(p + "post_attention_layernorm.weight", (d,)),
             q_norm=t.take(p + "self_attn.q_norm.weight", (c.head_dim,)),
             k_norm=t.take(p + "self_attn.k_norm.weight", (c.head_dim,)))
    per_layer.append(w)
  params = {k: np.stack([w[k] for w in per_layer]) for k in per_layer[0]}
  params.update(fc=t.take("fc.weight", (d, len(taps) * d)).T,
                ctx_norm=t.take("hidden_norm.weight", (d,)),
                final_norm=t.take("norm.weight", (d,)),
                # The mask token's row of the target's embedding: exactly what DFlash feeds.
                mask_embed=np.asarray(target.embed[...][int(mask_id)]))
  t.check_empty("block drafter")
  config = dict(kind="block", block_size=int(block) - 1, taps=taps, num_layers=nl,
                num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                intermediate_size=c.intermediate_size, draft_vocab_size=0, qk_norm=True)
  return config, params, {}, None


def load_hf_drafter(path: str | os.PathLike, *, target: Any,
                    rngs: nnx.Rngs | None = None) -> nnx.Module:
  """Reads an EAGLE-3 or DFlash checkpoint directory into our drafter for `target`.

  Args:
    path: directory with config.json and model.safetensors (sharded or not)
      or pytorch_model.bin.
    target: the target `Transformer`; float weights are cast to its dtype.
    rngs: RNG streams of the construction (every weight is overwritten).

  Returns:
    An `Eagle3Drafter` or a `BlockDrafter`.

  Raises:
    ModelLoadError: missing / unreadable files, missing or misshapen tensors.
    CheckpointFormatError: an unknown layout, or one our drafters cannot represent.
    DrafterMismatchError: the checkpoint belongs to another target.
  """
  path = os.path.abspath(os.fspath(path))
  hf = hf_loader.read_hf_config(path)
  kind = detect_kind(hf, source=os.path.join(path, CONFIG_FILE))
  tensors = _read_tensors(path)
  read = _read_eagle3 if kind == "eagle3" else _read_dflash
  config, params, model_state, embed = read(hf, tensors, target, source=path)
  drafter = io_lib.build_for_loading(config, target=target, rngs=rngs)
  _, param_state, _, _, state = io_lib.split_drafter(drafter)
  dtype = getattr(target, "dtype", jnp.float32)
  nnx.update(drafter, io_lib.assign(param_state, params, dtype=dtype, what="Weights",
                                    source=path))
  if model_state:
    nnx.update(drafter, io_lib.assign(state, model_state, dtype=dtype, what="Variables",
                                      source=path))
  if embed is not None:
    # The checkpoint ships its own (frozen) embedding: use it, not the target's.
    drafter.embed = Frozen(jnp.asarray(embed, dtype))
  drafter.check_target(target.config)
  return drafter


# ------------------------------------------------------------------ writing
def _np(x: Any, dtype: Any | None) -> np.ndarray:
  a = np.asarray(x)
  return a if dtype is None or not np.issubdtype(a.dtype, np.floating) else a.astype(dtype)


def _split_layer(w: Mapping[str, np.ndarray], prefix: str, spec) -> dict[str, np.ndarray]:
  """Our fused [in, out] layer weights -> PyTorch [out, in] tensors under `prefix`."""
  q, kv, f = spec.q_size, spec.kv_size, spec.intermediate_size
  a, m = prefix + "self_attn.", prefix + "mlp."
  return {
      a + "q_proj.weight": w["wqkv"][:, :q].T,
      a + "k_proj.weight": w["wqkv"][:, q:q + kv].T,
      a + "v_proj.weight": w["wqkv"][:, q + kv:].T,
      a + "o_proj.weight": w["wo"].T,
      m + "gate_proj.weight": w["w_gate_up"][:, :f].T,
      m + "up_proj.weight": w["w_gate_up"][:, f:].T,
      m + "down_proj.weight": w["w_down"].T,
  }


def _base_config(tc: TransformerConfig, spec, *, num_layers: int) -> dict[str, Any]:
  out = dict(hidden_size=tc.hidden_size, intermediate_size=spec.intermediate_size,
             num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
             head_dim=spec.head_dim, num_hidden_layers=num_layers, vocab_size=tc.vocab_size,
             rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
             max_position_embeddings=tc.max_position_embeddings, hidden_act="silu",
             tie_word_embeddings=False, attention_bias=False)
  if tc.rope_scaling is not None:
    rs = tc.rope_scaling
    out["rope_scaling"] = dict(rope_type="llama3", factor=rs.factor,
                               low_freq_factor=rs.low_freq_factor,
                               high_freq_factor=rs.high_freq_factor,
                               original_max_position_embeddings=rs.original_max_position_embeddings)
  return out


def _eagle3_layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  s, tc = drafter.spec, drafter.target_config
  if s.qk_norm:
    raise CheckpointFormatError("This EAGLE-3 drafter uses q/k norms, which the EAGLE-3 layout"
                                " (and SGLang / vLLM) has no place for.")
  w = {k: _np(getattr(drafter, k)[...], dtype)
       for k in ("wqkv", "wo", "w_gate_up", "w_down", "fc", "input_norm", "hidden_norm",
                 "mlp_norm", "final_norm", "lm_head")}
  tensors = _split_layer(w, "midlayer.", s)
  tensors.update({
      "fc.weight": w["fc"].T,
      "midlayer.input_layernorm.weight": w["input_norm"],
      "midlayer.hidden_norm.weight": w["hidden_norm"],
      "midlayer.post_attention_layernorm.weight": w["mlp_norm"],
      "norm.weight": w["final_norm"],
      "lm_head.weight": w["lm_head"].T,
  })
  vd = drafter.draft_vocab_size
  if drafter.d2t is not None:
    d2t = np.asarray(drafter.d2t[...]).astype(np.int64)
    tensors["d2t"] = d2t - np.arange(vd, dtype=np.int64)  # offsets: target = draft + d2t
    tensors["t2d"] = np.asarray(drafter.t2d[...]) >= 0
  config = _base_config(tc, s, num_layers=1)
  config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                draft_vocab_size=vd, target_hidden_size=tc.hidden_size,
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(drafter.taps)})
  return config, tensors


def _dflash_layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  s, tc = drafter.spec, drafter.target_config
  if drafter.reduced_vocab:
    raise CheckpointFormatError(
        f"This block drafter drafts over a reduced vocabulary ({s.draft_vocab_size} ids); the"
        " DFlash layout has no draft vocabulary (it always uses the target's whole head).")
  if not s.qk_norm:
    raise CheckpointFormatError("This block drafter has no q/k norms; DFlash layers always"
                                " apply them (train it with qk_norm=True).")
  mask = np.asarray(drafter.mask_embed[...])
  embed = np.asarray(drafter.embed[...]).astype(mask.dtype)
  rows = np.flatnonzero((embed == mask[None, :]).all(axis=1))
  if not rows.size:
    raise CheckpointFormatError(
        "This block drafter's mask embedding is a learned vector, not a row of the target's"
        " embedding; the DFlash layout stores only a mask_token_id whose embedding is fed.")
  w = {k: _np(getattr(drafter, k)[...], dtype)
       for k in ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm", "q_norm",
                 "k_norm", "fc", "ctx_norm", "final_norm")}
  tensors = {"fc.weight": w["fc"].T, "hidden_norm.weight": w["ctx_norm"],
             "norm.weight": w["final_norm"]}
  for i in range(s.num_layers):
    p = f"layers.{i}."
    tensors.update(_split_layer({k: x[i] for k, x in w.items()}, p, s))
    tensors.update({p + "input_layernorm.weight": w["attn_norm"][i],
                    p + "post_attention_layernorm.weight": w["mlp_norm"][i],
                    p + "self_attn.q_norm.weight": w["q_norm"][i],
                    p + "self_attn.k_norm.weight": w["k_norm"][i]})
  config = _base_config(tc, s, num_layers=s.num_layers)
  block = s.block_size + 1
  dflash = {"mask_token_id": int(rows[0]), "target_layer_ids": list(drafter.taps),
            "block_size": block}
  config.update(architectures=[DFLASH_ARCHITECTURE], model_type="qwen3", block_size=block,
                num_target_layers=tc.num_layers, dflash_config=dflash)
  return config, tensors


def export_hf(drafter: nnx.Module, path: str | os.PathLike, *, target_name: str = "",
              dtype: Any | None = None) -> str:
  """Writes `drafter` as config.json + model.safetensors in the public layout of its kind.

  EAGLE-3 drafters are written in SpecForge's layout (`midlayer.`, d2t offsets,
  t2d mask), block drafters in z-lab's DFlash layout. The target's embedding
  and LM head are not written (readers take the target's), as upstream.

  Args:
    drafter: an `Eagle3Drafter` or `BlockDrafter`.
    path: output directory (created; its config.json and model.safetensors
      are replaced).
    target_name: recorded in config.json (informational).
    dtype: storage dtype of float weights (default: as they are).

  Returns:
    The directory.

  Raises:
    CheckpointFormatError: the drafter uses something the layout cannot hold.
  """
  from dloop_jax.drafters.block import BlockDrafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters.eagle3 import Eagle3Drafter  # pylint: disable=g-import-not-at-top
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  if isinstance(drafter, Eagle3Drafter):
    config, tensors = _eagle3_layout(drafter, dtype)
  elif isinstance(drafter, BlockDrafter):
    config, tensors = _dflash_layout(drafter, dtype)
  else:
    raise CheckpointFormatError(f"{type(drafter).__name__} has no Hugging Face layout; only"
                                " EAGLE-3 and block drafters can be written in one.")
  floats = {str(x.dtype) for x in tensors.values() if np.issubdtype(x.dtype, np.floating)
            or x.dtype.name == "bfloat16"}
  config["torch_dtype"] = floats.pop() if len(floats) == 1 else "float32"
  config[META_KEY] = {"block_size": int(drafter.block_size), "target": target_name,
                      "target_fingerprint": dict(drafter.target_fingerprint)}
  path = os.path.abspath(os.fspath(path))
  os.makedirs(path, exist_ok=True)
  config_path = os.path.join(path, CONFIG_FILE)
  if os.path.exists(config_path):
    os.remove(config_path)  # incomplete until the new config lands
  safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                              os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})
  with open(config_path + ".tmp", "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  os.replace(config_path + ".tmp", config_path)
  return path
