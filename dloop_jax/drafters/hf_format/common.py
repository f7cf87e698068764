"""What every Hugging Face drafter layout shares: files, tensors, checks, shapes.

Conventions: PyTorch matrices are [out, in], ours [in, out]; q/k/v and
gate/up are fused into our `wqkv` / `w_gate_up` (columns in that order).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from dloop_jax.errors import CheckpointFormatError, DrafterMismatchError, ModelLoadError
from dloop_jax.models import hf_loader
from dloop_jax.models import rope as rope_lib
from dloop_jax.models.config import TransformerConfig

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
# Our own metadata in an exported config.json (ignored by other readers).
META_KEY = "dloop_jax"


def torch_files(path: str) -> list[str]:
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


def read_tensors(path: str) -> dict[str, np.ndarray]:
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
  for file in torch_files(path):
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


class Tensors:
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


def layer_config(hf: Mapping[str, Any], family: str, *, source: str) -> TransformerConfig:
  """Shapes, RoPE and epsilon of a drafter's config.json, parsed as the target's are."""
  plain = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
  plain["model_type"] = family
  plain.setdefault("rms_norm_eps", 1e-6)
  try:
    return TransformerConfig.from_hf_config(plain, name=os.path.basename(source))
  except KeyError as e:
    raise ModelLoadError(f"{source}/config.json lacks {e.args[0]!r}.") from e


def check_fits(pairs: list[tuple[str, Any, Any]], taps: list[int], target: TransformerConfig,
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


def common_pairs(hf: Mapping[str, Any], c: TransformerConfig,
                  target: TransformerConfig) -> list[tuple[str, Any, Any]]:
  """(field, checkpoint, target) pairs that must agree for every layout.

  RoPE is not among them: a drafter rotates with its own settings (`drafter_rope`).
  """
  pairs = [("hidden_size", c.hidden_size, target.hidden_size),
           ("vocab_size", c.vocab_size, target.vocab_size),
           ("rms_norm_eps", c.rms_norm_eps, target.rms_norm_eps)]
  # Our own exports also record the target's depth, which the layouts do not.
  mine = dict((hf.get(META_KEY) or {}).get("target_fingerprint") or {})
  if "num_layers" in mine:
    pairs.append(("target num_layers", mine["num_layers"], target.num_layers))
  return pairs


def drafter_rope(c: TransformerConfig, target: TransformerConfig) -> dict[str, Any]:
  """The RoPE keys of our drafter config for a checkpoint's parsed config.json.

  A checkpoint's drafter rotates with its own config's settings, as the
  upstream code does: theta 10000 when config.json has no rope_theta (EAGLE-3
  drafters of Llama-3.1 carry neither theta nor scaling, whatever the target's).
  Settings equal to the target's are left implicit (none of its own), so a
  drafter of ours reads back exactly as it was written.
  """
  if c.rope_theta == target.rope_theta and c.rope_scaling == target.rope_scaling:
    return {}
  return dict(rope_theta=float(c.rope_theta), rope_scaling=rope_lib.scaling_to_dict(c.rope_scaling))


def check_fc(tensors: Mapping[str, np.ndarray], taps: list[int], d: int, *, source: str) -> None:
  """fc must read one hidden state per tap: say so rather than report a bare shape."""
  fc = tensors.get("fc.weight")
  if fc is not None and fc.ndim == 2 and fc.shape[0] == d and fc.shape[1] != len(taps) * d:
    raise CheckpointFormatError(
        f"{source}: fc.weight reads {fc.shape[1] / d:g} hidden states of width {d}, but the"
        f" config's taps are {taps} ({len(taps)}); set the tapped layer ids in config.json.")


def attention(t: Tensors, prefix: str, c: TransformerConfig,
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


def to_np(x: Any, dtype: Any | None = None) -> np.ndarray:
  """A weight on this host (gathered when it is split over several processes), cast."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    x = multihost_utils.process_allgather(x, tiled=True)
  a = np.asarray(x)
  return a if dtype is None or not np.issubdtype(a.dtype, np.floating) else a.astype(dtype)


def split_layer(w: Mapping[str, np.ndarray], prefix: str, spec) -> dict[str, np.ndarray]:
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


def base_config(tc: TransformerConfig, spec, *, num_layers: int) -> dict[str, Any]:
  """The config.json keys every layout shares, the drafter's RoPE written out in full.

  A drafter without RoPE of its own rotates as the target does: its export
  states the target's theta and scaling, since readers take a missing
  rope_theta for 10000.
  """
  theta, scaling = ((tc.rope_theta, tc.rope_scaling) if spec.rope_theta is None
                    else (spec.rope_theta, spec.rope_scaling))
  out = dict(hidden_size=tc.hidden_size, intermediate_size=spec.intermediate_size,
             num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
             head_dim=spec.head_dim, num_hidden_layers=num_layers, vocab_size=tc.vocab_size,
             rms_norm_eps=tc.rms_norm_eps, rope_theta=float(theta),
             max_position_embeddings=tc.max_position_embeddings, hidden_act="silu",
             tie_word_embeddings=False, attention_bias=False)
  if scaling is not None:
    out["rope_scaling"] = rope_lib.scaling_to_dict(scaling)
  return out


EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"


def _target_head(target) -> np.ndarray:
  """The target's LM head as PyTorch stores it, [V, D] (tied: the embedding)."""
  head = target.matrix("lm_head").T if target.lm_head is not None else target.matrix("embed")
  return np.asarray(head, np.float32)


def check_frozen_copies(t: Tensors, target, *, source: str) -> None:
  """Takes the copies of the target's embedding / LM head some layouts ship; they must be the
  target's (up to their storage precision), since our drafters read the target's own."""
  v, d = target.config.vocab_size, target.config.hidden_size
  for name, ours in ((EMBED, lambda: np.asarray(target.matrix("embed"), np.float32)),
                     (LM_HEAD, lambda: _target_head(target))):
    if not t.has(name):
      continue
    theirs = np.asarray(t.take(name, (v, d)), np.float32)
    want = ours()
    if np.abs(theirs - want).max() > 1e-2 * max(float(np.abs(want).max()), 1e-6):
      raise DrafterMismatchError(
          f"Drafter {source}: its frozen copy {name!r} is not the target's"
          f" ({target.config.name or 'this target'}): it was trained for another target. Use a"
          " drafter trained for this target.")


def frozen_copies(drafter, dtype: Any | None) -> dict[str, np.ndarray]:
  """The target's embedding and LM head as the drafter holds them, [V, D] each."""
  embed = np.asarray(drafter.embed[...])
  head = embed if drafter.lm_head is None else np.asarray(drafter.lm_head[...]).T
  return {EMBED: to_np(embed, dtype), LM_HEAD: to_np(head, dtype)}
