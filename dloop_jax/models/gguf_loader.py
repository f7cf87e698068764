"""Loads llama.cpp GGUF checkpoints (Llama family, Qwen2, Qwen3) into our layout.

Quantized tensors are dequantized to float on load (the model runs in f32 or
bf16; nothing stays packed). Two llama.cpp conventions are undone here:

- Tensors are stored in ggml dimension order, which numpy sees as HF's
  `[out, in]`; our layout wants `[in, out]`, so matrices are transposed.
- For Llama-family models `convert_hf_to_gguf.py` permutes the rows of
  q_proj / k_proj (weights and biases) from HF's `rotate_half` layout into
  llama.cpp's interleaved-pairs layout; `_unpermute_rows` reverses it, exactly
  as transformers' GGUF loader does. Qwen2 / Qwen3 are stored unpermuted.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from dloop_jax.errors import ModelLoadError
from dloop_jax.models.config import RopeScaling, TransformerConfig
from dloop_jax.models.hf_loader import layer_slots
from dloop_jax.models.transformer import param_shapes

# `general.architecture` -> our family.
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED = frozenset({"llama", "mistral"})

# GGUF per-block tensor name -> role (see `hf_loader.layer_slots`).
_BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}


class _Reader(gguf.GGUFReader):
  """`gguf.GGUFReader` over a plain ndarray view of the memory map.

  The reader slices its `data` memmap once per metadata part (about 250k times
  for a 49k-token vocabulary), and every `np.memmap` slice runs a Python
  `__array_finalize__`; a plain view of the same mapping skips that call.
  """

  @property
  def data(self) -> np.ndarray:
    return self._plain_data

  @data.setter
  def data(self, value: np.ndarray) -> None:
    self._plain_data = value.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
  """Opens a GGUF file, turning every way it can be unreadable into a `ModelLoadError`."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise ModelLoadError(
        f"GGUF file {path!r} does not exist. Check the path (or use a registry name).")
  if not os.path.isfile(path):
    raise ModelLoadError(f"{path!r} is not a file; a GGUF checkpoint is a single .gguf file.")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise ModelLoadError(
        f"{path!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'). It may be corrupt or"
        " another format; re-download it, or pass a Hugging Face directory instead.")
  try:
    reader = _Reader(path)
  except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
    raise ModelLoadError(
        f"GGUF file {path!r} ({os.path.getsize(path)} bytes) is truncated or corrupt: the reader"
        f" failed with {type(e).__name__}: {str(e).rstrip('.')}. Re-download or re-copy the"
        " file.") from e
  # The reader slices tensors out of a memory map, which silently shortens a
  # slice past the end of the file; check the sizes ourselves.
  size = os.path.getsize(path)
  for tensor in reader.tensors:
    end = tensor.data_offset + tensor.n_bytes
    if end > size or tensor.data.nbytes != tensor.n_bytes:
      raise ModelLoadError(
          f"GGUF file {path!r} is truncated: tensor {tensor.name!r} ends at byte {end} but the file"
          f" has {size} bytes. Re-download or re-copy the file.")
  return reader


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
  field = reader.get_field(key)
  if field is None:
    return default
  try:
    return field.contents()
  except Exception as e:
    raise ModelLoadError(
        f"GGUF metadata field {key!r} is corrupt ({type(e).__name__}: {e}).") from e


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: interleaved rotary pairs -> `rotate_half` halves.

  Args:
    w: [num_heads * head_dim, ...] rows of q_proj or k_proj (weight or bias).
    num_heads: heads the rows belong to (kv heads for k_proj).

  Returns:
    The same shape, rows reordered per head from (pair, 2) to (2, pair).
  """
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_scaling_from_factors(factors: np.ndarray, config: TransformerConfig) -> RopeScaling:
  """Recovers Llama-3 RoPE scaling parameters from llama.cpp's `rope_freqs` tensor.

  llama.cpp stores the per-frequency divisors instead of the parameters. Every
  released Llama 3.1 / 3.2 uses low 1, high 4, original context 8192 and a
  factor equal to the largest divisor; accept that only if it reproduces the
  tensor.
  """
  from dloop_jax.models import rope as rope_lib  # local: rope imports config only

  scaling = RopeScaling(factor=float(np.max(factors)), low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
  plain = rope_lib.inverse_frequencies(config)
  scaled = rope_lib.inverse_frequencies(
      dataclasses.replace(config, rope_scaling=scaling))
  if factors.shape != plain.shape or not np.allclose(plain / factors, scaled, rtol=1e-4):
    raise ModelLoadError(
        "This GGUF stores custom RoPE frequency factors (`rope_freqs.weight`) that do not match"
        " Llama-3 scaling with the usual parameters; load the Hugging Face checkpoint instead.")
  return scaling


def config_from_gguf(reader: gguf.GGUFReader, *, name: str = "",
                     tensor_names: set[str] | None = None) -> TransformerConfig:
  """Builds a `TransformerConfig` from GGUF metadata (`{arch}.*` and `tokenizer.ggml.*` keys)."""
  arch = _field(reader, "general.architecture")
  if arch not in _ARCHITECTURES:
    raise ModelLoadError(
        f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHITECTURES))}."
        " Use a GGUF of a Llama-family, Qwen2 or Qwen3 model.")
  family = _ARCHITECTURES[arch]
  tensor_names = tensor_names if tensor_names is not None else {t.name for t in reader.tensors}

  def key(suffix: str, default: Any = None, *, required: bool = False) -> Any:
    value = _field(reader, f"{arch}.{suffix}", default)
    if required and value is None:
      raise ModelLoadError(
          f"GGUF metadata lacks {arch}.{suffix}; the file is incomplete or corrupt.")
    return value

  hidden = int(key("embedding_length", required=True))
  num_heads = int(key("attention.head_count", required=True))
  num_kv_heads = key("attention.head_count_kv", num_heads)
  if isinstance(num_kv_heads, list):
    if len(set(num_kv_heads)) != 1:
      raise ModelLoadError(f"Per-layer kv head counts {num_kv_heads} are not supported.")
    num_kv_heads = num_kv_heads[0]
  head_dim = int(key("attention.key_length", hidden // num_heads))
  rope_dim = key("rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != head_dim:
    raise ModelLoadError(
        f"Partial rotary embeddings (rope dim {rope_dim}, head dim {head_dim}) are not supported.")
  scaling_type = key("rope.scaling.type")
  if scaling_type not in (None, "none"):
    raise ModelLoadError(f"GGUF RoPE scaling type {scaling_type!r} is not supported.")

  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None or len(embed.shape) != 2:
    raise ModelLoadError(
        "GGUF has no 2-D token_embd.weight tensor; the file is incomplete or corrupt.")
  # The embedding (ggml order [D, V]) decides the model's vocabulary, which can
  # be padded past the tokenizer's.
  vocab_size = int(embed.shape[1])
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  eos_ids = []
  for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
    value = _field(reader, f"tokenizer.ggml.{k}")
    if value is not None and int(value) not in eos_ids:
      eos_ids.append(int(value))

  config = TransformerConfig(
      family=family,
      vocab_size=vocab_size,
      hidden_size=hidden,
      intermediate_size=int(key("feed_forward_length", required=True)),
      num_layers=int(key("block_count", required=True)),
      num_heads=num_heads,
      num_kv_heads=int(num_kv_heads),
      head_dim=head_dim,
      rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=float(key("rope.freq_base", 10000.0)),
      max_position_embeddings=int(key("context_length", 2048)),
      tie_embeddings="output.weight" not in tensor_names,
      attention_bias="blk.0.attn_q.bias" in tensor_names,
      qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=tuple(eos_ids),
      name=name or str(_field(reader, "general.name", "")),
  )
  if family == "qwen3" and not config.qk_norm:
    raise ModelLoadError(
        "Qwen3 GGUF without attn_q_norm / attn_k_norm tensors; the file is incomplete.")
  return config


def _dequantize(tensor: Any) -> np.ndarray:
  """One GGUF tensor as float32, in numpy order ([out, in] for matrices)."""
  try:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError as e:
    raise ModelLoadError(
        f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which the gguf"
        f" package cannot dequantize ({e}). Use another quantization of the model.") from e
  except Exception as e:
    raise ModelLoadError(
        f"GGUF tensor {tensor.name!r} is corrupt ({type(e).__name__}: {e}).") from e
  # F32 / F16 tensors come back as views of the memory map; the caller copies.
  return np.asarray(values, dtype=np.float32)


def load_gguf(path: str | os.PathLike, *, dtype=jnp.float32, name: str = "",
              reader: gguf.GGUFReader | None = None,
              ) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
  """Reads a GGUF checkpoint.

  Args:
    path: the .gguf file.
    dtype: dtype of the returned arrays (f32, or bf16 for accelerators).
    name: model name for the config (default: the file's `general.name`).
    reader: the file already opened with `open_gguf` (the tokenizer reads the
      same metadata).

  Returns:
    `(config, params)` with `params` in `transformer.param_shapes` layout.

  Raises:
    ModelLoadError: missing, truncated or corrupt file, unsupported
      architecture or quantization, or tensors that do not fit the metadata.
  """
  path = os.fspath(path)
  reader = reader if reader is not None else open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  config = config_from_gguf(reader, name=name, tensor_names=set(tensors))
  arch = _field(reader, "general.architecture")
  c = config

  if "rope_freqs.weight" in tensors:
    factors = _dequantize(tensors.pop("rope_freqs.weight")).reshape(-1)
    config = c = dataclasses.replace(c, rope_scaling=_llama3_scaling_from_factors(factors, c))

  # Group the tensors by layer before reading any, so missing or unknown ones
  # fail fast, and then dequantize each straight into its slot of the stacked
  # arrays (one copy per weight: stacking and transposing afterwards doubles
  # the load time).
  per_layer: list[dict[str, Any]] = [{} for _ in range(c.num_layers)]
  unexpected = []
  for tensor_name, tensor in tensors.items():
    if tensor_name.startswith("blk."):
      _, index, leaf = tensor_name.split(".", 2)
      role = _BLOCK_TENSORS.get(leaf)
      if role is None or not index.isdigit() or int(index) >= c.num_layers:
        unexpected.append(tensor_name)
      else:
        per_layer[int(index)][role] = tensor
    elif tensor_name not in ("token_embd.weight", "output_norm.weight", "output.weight"):
      unexpected.append(tensor_name)
  if unexpected:
    raise ModelLoadError(
        f"GGUF {path!r} holds tensors this loader does not know: {sorted(unexpected)[:8]}. The"
        " model has parts our transformer lacks (e.g. output biases); it is not supported.")
  if "output_norm.weight" not in tensors:
    raise ModelLoadError(f"GGUF {path!r} has no output_norm.weight; the file is incomplete.")

  wanted = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
  if c.attention_bias:
    wanted |= {"bq", "bk", "bv"}
  if c.qk_norm:
    wanted |= {"q_norm", "k_norm"}
  for index, layer in enumerate(per_layer):
    if set(layer) != wanted:
      raise ModelLoadError(
          f"GGUF {path!r} block {index}: missing {sorted(wanted - set(layer))}, unexpected"
          f" {sorted(set(layer) - wanted)}; the file is incomplete or an unsupported variant.")

  np_dtype = np.dtype(dtype)
  params = {name: np.empty(shape, np_dtype) for name, shape in param_shapes(c).items()}
  permuted = arch in _PERMUTED
  heads = {"wq": c.num_heads, "bq": c.num_heads, "wk": c.num_kv_heads, "bk": c.num_kv_heads}
  # Matrices are [out, in] in the file, [in, out] here.
  slots = layer_slots(c)
  for index, layer in enumerate(per_layer):
    for role, tensor in layer.items():
      value = _dequantize(tensor)
      if permuted and role in heads:
        value = _unpermute_rows(value, heads[role])
      if value.ndim == 2:
        value = value.T
      name, columns = slots[role]
      target = params[name][index]
      if columns is not None:
        target = target[..., columns]
      _assign(target, value, tensor.name, path)
  _assign(params["embed"], _dequantize(tensors["token_embd.weight"]), "token_embd.weight", path)
  _assign(params["final_norm"], _dequantize(tensors["output_norm.weight"]), "output_norm.weight",
          path)
  if not c.tie_embeddings:
    _assign(params["lm_head"], _dequantize(tensors["output.weight"]).T, "output.weight", path)
  return config, params


def _assign(target: np.ndarray, value: np.ndarray, tensor_name: str, path: str) -> None:
  """Copies `value` into `target` (a view), after checking the shape the metadata implies."""
  if value.shape != target.shape:
    raise ModelLoadError(
        f"GGUF {path!r}: tensor {tensor_name!r} has shape {value.shape} (as [in, out]) but the"
        f" metadata implies {target.shape}; the file's metadata and tensors disagree.")
  target[...] = value
