"""Loads Hugging Face checkpoint directories (config.json + safetensors) into our layout.

Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`,
maps HF parameter names onto the stacked layout of `transformer.param_shapes`
and transposes HF's `[out, in]` matrices to `[in, out]`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors

from dloop_jax.errors import ModelLoadError
from dloop_jax.models.config import TransformerConfig
from dloop_jax.models.transformer import param_shapes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# HF per-layer leaf name -> role (see `layer_slots`).
_LAYER_PARAMS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_TOP_PARAMS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}


def layer_slots(config: TransformerConfig) -> dict[str, tuple[str, slice | None]]:
  """Per-layer role -> (our stacked parameter, column slice within it, or None).

  Shared by the HF and GGUF loaders: roles name the unfused HF / GGUF
  tensors, slices place them in the fused `wqkv`, `bqkv` and `w_gate_up`.
  """
  q, kv, f = config.q_size, config.kv_size, config.intermediate_size
  return {
      "attn_norm": ("layers.attn_norm", None),
      "wq": ("layers.wqkv", slice(0, q)),
      "wk": ("layers.wqkv", slice(q, q + kv)),
      "wv": ("layers.wqkv", slice(q + kv, q + 2 * kv)),
      "bq": ("layers.bqkv", slice(0, q)),
      "bk": ("layers.bqkv", slice(q, q + kv)),
      "bv": ("layers.bqkv", slice(q + kv, q + 2 * kv)),
      "q_norm": ("layers.q_norm", None),
      "k_norm": ("layers.k_norm", None),
      "wo": ("layers.wo", None),
      "mlp_norm": ("layers.mlp_norm", None),
      "w_gate": ("layers.w_gate_up", slice(0, f)),
      "w_up": ("layers.w_gate_up", slice(f, 2 * f)),
      "w_down": ("layers.w_down", None),
  }


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The `config.json` of a checkpoint directory, merged with `generation_config.json` stop ids."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise ModelLoadError(
        f"{path!r} is not a directory; expected a Hugging Face checkpoint directory.")
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise ModelLoadError(
        f"{path!r} has no config.json, so it is not a Hugging Face checkpoint directory. Save one"
        " with `model.save_pretrained(dir)` or download the full repository.")
  try:
    with open(config_path) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ModelLoadError(f"{config_path!r} is not valid JSON ({e}); re-download it.") from e
  generation_path = os.path.join(path, "generation_config.json")
  if os.path.isfile(generation_path):
    try:
      with open(generation_path) as f:
        generation = json.load(f)
    except (OSError, json.JSONDecodeError):
      generation = {}
    # Instruct models often stop on more tokens than config.json's eos.
    eos = generation.get("eos_token_id")
    if eos is not None:
      merged = _as_list(hf.get("eos_token_id"))
      merged += [e for e in _as_list(eos) if e not in merged]
      hf = {**hf, "eos_token_id": merged}
  return hf


def _as_list(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _weight_files(path: str) -> list[str]:
  """The safetensors files holding the weights, from the index when sharded."""
  single = os.path.join(path, "model.safetensors")
  index_path = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise ModelLoadError(f"{index_path!r} is not a valid safetensors index ({e}).") from e
    files = [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise ModelLoadError(
          f"Shards listed in {index_path!r} are missing: {[os.path.basename(m) for m in missing]}."
          " Download the complete checkpoint.")
    return files
  if os.path.isfile(single):
    return [single]
  others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".gguf")))
  hint = (f" Found {others}: only safetensors are read (re-save with"
          " `save_pretrained(dir, safe_serialization=True)`, or pass the .gguf file itself)."
          if others else "")
  raise ModelLoadError(f"{path!r} has no model.safetensors or model.safetensors.index.json.{hint}")


def _iter_tensors(files: list[str]) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) for every tensor in the files; bf16 arrays come back as ml_dtypes.bfloat16."""
  for file in files:
    try:
      with safetensors.safe_open(file, framework="numpy") as f:
        names = list(f.keys())
        # numpy has no bfloat16, so the numpy framework refuses BF16 tensors;
        # those go through the flax framework, which returns jax arrays.
        bf16 = {n for n in names if f.get_slice(n).get_dtype() == "BF16"}
        for name in names:
          if name not in bf16:
            yield name, f.get_tensor(name)
      if bf16:
        with safetensors.safe_open(file, framework="flax") as f:
          for name in bf16:
            yield name, np.asarray(f.get_tensor(name))
    except ModelLoadError:
      raise
    except Exception as e:  # safetensors raises its own error types on bad headers
      raise ModelLoadError(
          f"Could not read {file!r} ({type(e).__name__}: {e}); it is truncated or corrupt."
          " Re-download it.") from e


def load_hf_dir(path: str | os.PathLike, *, dtype=jnp.float32,
                name: str = "") -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face checkpoint directory.

  Args:
    path: directory with `config.json` and `model.safetensors` (or a sharded
      `model.safetensors.index.json`).
    dtype: dtype of the returned arrays.
    name: model name for the config (default: the directory's name).

  Returns:
    `(config, params)` with `params` in `transformer.param_shapes` layout.

  Raises:
    ModelLoadError: missing / unreadable files, weights that do not match the config.
    ConfigError: unknown architecture or unsupported config values.
  """
  path = os.fspath(path)
  hf = read_hf_config(path)
  config = TransformerConfig.from_hf_config(
      hf, name=name or os.path.basename(os.path.normpath(path)))
  files = _weight_files(path)
  c = config
  np_dtype = np.dtype(dtype)
  shapes = param_shapes(c)
  params = {n: np.empty(shape, np_dtype) for n, shape in shapes.items()}
  slots = layer_slots(c)
  filled: set[tuple[str, int]] = set()
  unexpected = []
  for hf_name, value in _iter_tensors(files):
    match = _LAYER.match(hf_name)
    if match:
      index, leaf = int(match.group(1)), match.group(2)
      role = _LAYER_PARAMS.get(leaf)
      if role is None or index >= c.num_layers or slots[role][0] not in params:
        if not leaf.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved
          unexpected.append(hf_name)
        continue
      param, columns = slots[role]
      target = params[param][index]
      if columns is not None:
        target = target[..., columns]
      key = (role, index)
    elif hf_name in _TOP_PARAMS:
      param = _TOP_PARAMS[hf_name]
      if param not in params:  # lm_head saved next to tied embeddings: same values
        continue
      target, key = params[param], (param, -1)
    else:
      unexpected.append(hf_name)
      continue
    # HF matrices are [out, in] (embeddings [V, D] already match ours).
    transposed = value.ndim == 2 and param != "embed"
    expected = tuple(reversed(target.shape)) if transposed else target.shape
    if value.shape != expected:
      raise ModelLoadError(
          f"Weight {hf_name!r} in {path!r} has shape {value.shape}, config.json implies"
          f" {expected}: it does not match config.json (the weights belong to another config).")
    target[...] = value.T if transposed else value
    filled.add(key)
  if unexpected:
    raise ModelLoadError(
        f"{path!r} holds weights our transformer has no place for: {sorted(unexpected)[:8]}"
        f"{' ...' if len(unexpected) > 8 else ''}. The model uses features we do not support"
        " (e.g. output-projection or MLP biases).")
  needed = {(p, -1) for p in ("embed", "final_norm", "lm_head") if p in params}
  needed |= {(role, i) for role, (p, _) in slots.items() if p in params
             for i in range(c.num_layers)}
  missing = needed - filled
  if missing:
    names = sorted(f"{r}[layer {i}]" if i >= 0 else r for r, i in missing)
    raise ModelLoadError(
        f"Weights missing from {path!r}: {names[:8]}{' ...' if len(names) > 8 else ''}."
        " The checkpoint is incomplete or does not match config.json.")
  return config, params
