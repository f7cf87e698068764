"""Tiny random transformers models saved as HF directories or GGUF files (test helpers)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Sequence
from unittest import mock

import gguf
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from dloop_jax.models import LoadedTarget, gguf_loader, load_target
from dloop_jax.models.transformer import Transformer

# One thread per test process: pytest-xdist runs a worker per core, and torch's
# OpenMP threads spin-wait for a core the other worker holds (a [1, 576] x
# [576, 3072] product took 7.1 ms with 2 threads, 0.3 ms with 1, while another
# process kept one of the 2 cores busy).
torch.set_num_threads(1)

REAL_MODEL = "smollm2-135m-instruct"

# Shared by every tiny config: small enough to compile and run in a second.
_BASE = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, pad_token_id=None,
)

# name -> (config class, overrides). Covers GQA, tied / untied, Llama-3 RoPE
# scaling, Qwen2 q/k/v biases and Qwen3 per-head q/k norms with a head_dim
# that is not hidden / heads.
TINY_CONFIGS = {
    "llama_untied_llama3_rope": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, tie_word_embeddings=False, rope_theta=10000.0,
        # original context 16: wavelengths 6..20k cover all three frequency bands.
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_tied": (transformers.LlamaConfig, dict(
        num_hidden_layers=3, tie_word_embeddings=True, rope_theta=100000.0)),
    "qwen2_untied": (transformers.Qwen2Config, dict(
        num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1000000.0,
        use_sliding_window=False)),
    "qwen2_tied": (transformers.Qwen2Config, dict(
        num_hidden_layers=2, tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3_tied": (transformers.Qwen3Config, dict(
        num_hidden_layers=3, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=False)),
}


def tiny_hf_model(kind: str, *, seed: int = 0) -> transformers.PreTrainedModel:
  """A random tiny causal LM in f32 with eager attention.

  Every parameter is redrawn (norm weights around 1) so that norms, biases and
  the RoPE layout all influence the logits.
  """
  config_cls, overrides = TINY_CONFIGS[kind]
  config = config_cls(**{**_BASE, **overrides})
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model.eval()


def save_hf(model: transformers.PreTrainedModel, path: str, *,
            max_shard_size: str | None = None) -> str:
  """`save_pretrained` as safetensors (sharded when `max_shard_size` is given)."""
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, **kwargs)
  return path


def torch_logits(model: transformers.PreTrainedModel, tokens: np.ndarray) -> np.ndarray:
  """[B, T, V] float32 logits of the reference forward."""
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def flax_logits(model: Transformer, tokens: np.ndarray, *, split: int | None = None,
                compiled: bool = True) -> np.ndarray:
  """[B, T, V] logits of our forward through a KV cache.

  With `split`, the first `split` tokens are a prefill and the rest a second
  call against the filled cache, as in decoding. `compiled` runs each call as
  one program (a tiny model's forward op by op compiles about a hundred small
  ones); a 30-layer model is cheaper op by op (its layers share every op's
  compiled shape).
  """
  b, t = tokens.shape
  cache = model.init_cache(batch_size=b, capacity=t + 8)
  chunks = [(0, t)] if split is None else [(0, split), (split, t)]
  forward = _compiled_forward if compiled else _forward
  out = []
  for start, end in chunks:
    positions = jnp.arange(start, end)[None].repeat(b, 0)
    logits, cache = forward(model, jnp.asarray(tokens[:, start:end]), positions, cache)
    out.append(np.asarray(logits))
  assert int(cache.lengths[0]) == t
  return np.concatenate(out, axis=1)


def _forward(model, tokens, positions, cache):
  result = model(tokens, positions=positions, cache=cache)
  return result.logits, result.cache


_compiled_forward = nnx.jit(_forward)


@contextlib.contextmanager
def fast_gguf_reads():
  """transformers' GGUF loading, without its two slow spots (37 s -> 8 s for the real model).

  transformers parses a file through gguf's reader, whose every metadata slice of a
  `np.memmap` runs a Python hook (250k slices for a 49k-token vocabulary), and rebuilds
  gguf's tensor-name table for each tensor. Here the reader runs over a plain view of the
  mapping (the loader's `_Reader`: gguf's own parsing, only the memory access differs) and
  the table is built once per architecture.
  """
  with mock.patch.object(gguf, "GGUFReader", gguf_loader._Reader), \
       mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
    yield


@functools.cache
def real_pair() -> tuple[LoadedTarget, transformers.PreTrainedModel]:
  """(our LoadedTarget, transformers' model from the same GGUF) of the default model.

  Loaded once per test process: the parity and the generation tests share it.
  The reference runs in f32 with eager attention on transformers' own
  dequantization of the GGUF weights.
  """
  target = load_target(REAL_MODEL, dtype="float32")
  folder, name = os.path.split(target.source)
  with fast_gguf_reads():
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
  return target, reference


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """`convert_hf_to_gguf.py`'s `LlamaModel.permute`: rotate_half -> interleaved pairs."""
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config) -> np.ndarray:
  """`convert_hf_to_gguf.py`'s `rope_freqs` tensor for Llama-3 RoPE scaling."""
  rs = config.rope_parameters
  dim = config.head_dim
  freqs = 1.0 / (rs["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  old = rs["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
  factors = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      factors.append(1.0)
    elif wavelen > low_wavelen:
      factors.append(rs["factor"])
    else:
      low, high = rs["low_freq_factor"], rs["high_freq_factor"]
      smooth = (old / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / rs["factor"] + smooth))
  return np.asarray(factors, np.float32)


def char_tokens(vocab_size: int) -> list[str]:
  """A byte-level vocabulary whose printable ASCII characters are tokens of their own.

  ids 0-2 stay the special tokens (unk, bos, eos), then the space ("Ġ" in
  byte-level BPE) and the characters "!".."~": text of those characters
  encodes one token per character, so a command-line run can take a text
  prompt (`write_gguf`'s default vocabulary encodes text to its special
  tokens only).
  """
  chars = ["\u0120"] + [chr(c) for c in range(ord("!"), ord("~") + 1)]
  tokens = ["t0", "t1", "t2"] + chars
  assert len(tokens) <= vocab_size, vocab_size
  return tokens + [f"t{i}" for i in range(len(tokens), vocab_size)]


def write_gguf(model: transformers.PreTrainedModel, path: str, *, arch: str | None = None,
               rope_factors: np.ndarray | None = None,
               tokens: Sequence[str] | None = None) -> str:
  """Writes a model as llama.cpp's converter would (F32 tensors, llama q/k permuted).

  Args:
    model: a tiny Llama / Qwen2 / Qwen3 model.
    path: the .gguf file to write.
    arch: `general.architecture` to write (default from the model type; tests
      of unsupported architectures override it).
    rope_factors: optional `rope_freqs.weight` tensor.
    tokens: the vocabulary's token strings (default "t0".."t{V-1}"; see
      `char_tokens`).

  Returns:
    `path`.
  """
  c = model.config
  arch = arch or c.model_type
  head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  w = gguf.GGUFWriter(path, arch)
  w.add_name(f"tiny-{c.model_type}")
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  if c.model_type == "llama":
    w.add_rope_dimension_count(head_dim)
  w.add_tokenizer_model("gpt2")
  # Byte-level tokens; with scores and no merges, transformers derives the merges.
  w.add_token_list(list(tokens) if tokens is not None else [f"t{i}" for i in range(c.vocab_size)])
  w.add_token_scores([0.0] * c.vocab_size)
  w.add_bos_token_id(c.bos_token_id)
  w.add_eos_token_id(c.eos_token_id)
  w.add_unk_token_id(0)

  permute = c.model_type == "llama"
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  if not c.tie_word_embeddings:
    w.add_tensor("output.weight", sd["lm_head.weight"])
  if rope_factors is not None:
    w.add_tensor("rope_freqs.weight", rope_factors)
  leaves = {
      "input_layernorm.weight": "attn_norm.weight",
      "self_attn.q_proj.weight": "attn_q.weight",
      "self_attn.k_proj.weight": "attn_k.weight",
      "self_attn.v_proj.weight": "attn_v.weight",
      "self_attn.q_proj.bias": "attn_q.bias",
      "self_attn.k_proj.bias": "attn_k.bias",
      "self_attn.v_proj.bias": "attn_v.bias",
      "self_attn.q_norm.weight": "attn_q_norm.weight",
      "self_attn.k_norm.weight": "attn_k_norm.weight",
      "self_attn.o_proj.weight": "attn_output.weight",
      "post_attention_layernorm.weight": "ffn_norm.weight",
      "mlp.gate_proj.weight": "ffn_gate.weight",
      "mlp.up_proj.weight": "ffn_up.weight",
      "mlp.down_proj.weight": "ffn_down.weight",
  }
  for i in range(c.num_hidden_layers):
    for hf_leaf, gguf_leaf in leaves.items():
      value = sd.get(f"model.layers.{i}.{hf_leaf}")
      if value is None:
        continue
      if permute and hf_leaf.startswith("self_attn.q_proj"):
        value = _llama_cpp_permute(value, c.num_attention_heads)
      elif permute and hf_leaf.startswith("self_attn.k_proj"):
        value = _llama_cpp_permute(value, c.num_key_value_heads)
      w.add_tensor(f"blk.{i}.{gguf_leaf}", np.ascontiguousarray(value))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return os.fspath(path)
