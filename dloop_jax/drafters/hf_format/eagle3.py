"""EAGLE-3 (SafeAILab/EAGLE, SpecForge) <-> `Eagle3Drafter`.

    config   Llama, num_hidden_layers 1, draft_vocab_size,
             eagle_config.eagle_aux_hidden_state_layer_ids (taps)
    weights  fc, midlayer.* (or vLLM's layers.0.*), norm, lm_head, d2t, t2d

The drafter rotates with its config's RoPE (theta 10000 when absent, as the
upstream code: SafeAILab's and SpecForge's drafters for Llama-3.1 carry neither
rope_theta nor rope_scaling), not the target's. SpecForge's `norm_output: false`
(the head reads the un-normed state) is read and written.

EAGLE-3's `d2t` holds offsets (target_id = draft_id + d2t[draft_id]) and `t2d`
a [V] bool mask; ours hold the target ids and draft ids (-1 outside). Default
taps: `default_taps`.
"""

from __future__ import annotations

import numpy as np

from dloop_jax.drafters.hf_format import common
from dloop_jax.errors import CheckpointFormatError, ModelLoadError
from dloop_jax.models.config import default_taps

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
_DEFAULT_BLOCK = 4


def read(hf, tensors, target, *, source):
  """(drafter config, params, model_state, embedding or None) of an EAGLE-3 checkpoint."""
  c = common.layer_config(hf, "llama", source=source)
  tc = target.config
  d, v = c.hidden_size, c.vocab_size
  vd = int(hf.get("draft_vocab_size") or v)
  if int(hf.get("num_hidden_layers", 1)) != 1:
    raise CheckpointFormatError(f"{source}: an EAGLE-3 drafter has one decoder layer; config.json"
                                f" says num_hidden_layers={hf['num_hidden_layers']}.")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise CheckpointFormatError(f"{source}: EAGLE-3 layers with biases are not supported.")
  if hf.get("fc_norm"):
    raise CheckpointFormatError(f"{source}: fc_norm (an RMSNorm per tap before fc, SpecForge's"
                                " option) is not supported by our EAGLE-3 drafter.")
  eagle = dict(hf.get("eagle_config") or {})
  taps = [int(x) for x in eagle.get("eagle_aux_hidden_state_layer_ids")
          or default_taps(tc.num_layers)]
  common.check_fits(common.common_pairs(hf, c, tc) + [
      ("target_hidden_size", int(hf.get("target_hidden_size") or d), tc.hidden_size)],
              taps, tc, source=source)
  if not 0 < vd <= v:
    raise CheckpointFormatError(f"{source}: draft_vocab_size={vd} is not in [1, vocab_size={v}].")

  # vLLM renames `midlayer.` to `layers.0.`; some exports nest under `model.`.
  tensors = {k.removeprefix("model."): x for k, x in tensors.items()}
  common.check_fc(tensors, taps, d, source=source)
  prefix = "layers.0." if any(k.startswith("layers.0.") for k in tensors) else "midlayer."
  t = common.Tensors(tensors, source=source)
  params = common.attention(t, prefix, c, 2 * d)
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
  meta = dict(hf.get(common.META_KEY) or {})
  config = dict(kind="eagle3", block_size=int(meta.get("block_size", _DEFAULT_BLOCK)),
                taps=taps, num_layers=1, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                draft_vocab_size=vd if vd < v else 0, qk_norm=False,
                norm_output=bool(hf.get("norm_output", True)), **common.drafter_rope(c, tc))
  return config, params, model_state, embed


def layout(drafter, dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  s, tc = drafter.spec, drafter.target_config
  if s.qk_norm:
    raise CheckpointFormatError("This EAGLE-3 drafter uses q/k norms, which the EAGLE-3 layout"
                                " (and SGLang / vLLM) has no place for.")
  w = {k: common.to_np(getattr(drafter, k)[...], dtype)
       for k in ("wqkv", "wo", "w_gate_up", "w_down", "fc", "input_norm", "hidden_norm",
                 "mlp_norm", "final_norm", "lm_head")}
  tensors = common.split_layer(w, "midlayer.", s)
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
    d2t = common.to_np(drafter.d2t[...]).astype(np.int64)
    tensors["d2t"] = d2t - np.arange(vd, dtype=np.int64)  # offsets: target = draft + d2t
    tensors["t2d"] = common.to_np(drafter.t2d[...]) >= 0
  config = common.base_config(tc, s, num_layers=1)
  config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                draft_vocab_size=vd, target_hidden_size=tc.hidden_size,
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(drafter.taps)})
  if not s.norm_output:
    config["norm_output"] = False
  return config, tensors
