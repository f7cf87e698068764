"""Target transformer configuration (Llama / Mistral / SmolLM2 / Qwen2 / Qwen3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dloop_jax.errors import ConfigError

# `model_type` / `architectures` values of config.json that map onto our decoder.
_ARCHITECTURES = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "mistral": "llama",
    "MistralForCausalLM": "llama",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Static shape and numerics of a decoder-only target model.

  `family` is one of "llama" (Llama 2/3, SmolLM2, Mistral without sliding
  window), "qwen2" (bias on q/k/v) or "qwen3" (per-head RMSNorm on q and k).
  """

  family: str = "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 2048
  tie_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  name: str = ""

  def __post_init__(self):
    if self.family not in ("llama", "qwen2", "qwen3"):
      raise ConfigError(
          f"Unknown model family {self.family!r}; expected 'llama', 'qwen2' or"
          " 'qwen3'."
      )
    for field in ("vocab_size", "hidden_size", "intermediate_size",
                  "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"TransformerConfig.{field} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads"
          f" ({self.num_kv_heads}) for grouped-query attention."
      )

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  @property
  def fingerprint(self) -> dict[str, Any]:
    """What a drafter must agree on to be used with this target."""
    return {
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "num_layers": self.num_layers,
    }

  def num_params(self) -> int:
    d, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
    per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
    return l * per_layer + v * d * (1 if self.tie_embeddings else 2) + d

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], *, name: str = "") -> "TransformerConfig":
    """Builds a config from a Hugging Face `config.json` dictionary."""
    arch_keys = [hf.get("model_type")] + list(hf.get("architectures") or [])
    family = next((_ARCHITECTURES[k] for k in arch_keys if k in _ARCHITECTURES), None)
    if family is None:
      raise ConfigError(
          f"Unknown architecture in config.json (model_type={hf.get('model_type')!r},"
          f" architectures={hf.get('architectures')!r}). Supported: "
          + ", ".join(sorted({k for k in _ARCHITECTURES if k.islower()}))
          + "."
      )
    if hf.get("sliding_window") and hf.get("use_sliding_window", family == "llama"):
      if hf.get("model_type") == "mistral":
        raise ConfigError("Mistral with a sliding window is not supported (set sliding_window: null).")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    rope_scaling = None
    # transformers >= 5 writes the scaling (and rope_theta) under `rope_parameters`.
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if rs:
      rope_type = rs.get("rope_type", rs.get("type"))
      if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
      elif rope_type not in (None, "default"):
        raise ConfigError(f"Unsupported rope_scaling type {rope_type!r}; supported: 'llama3'.")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:
      rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return cls(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        name=name,
    )


def tiny_config(**overrides) -> TransformerConfig:
  """A small random-init config for tests and examples."""
  base = dict(
      family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
      max_position_embeddings=256, rope_theta=10000.0, name="tiny",
  )
  base.update(overrides)
  return TransformerConfig(**base)


def default_taps(num_layers: int) -> tuple[int, ...]:
  """Low / middle / high tapped layers (0-based decoder-layer outputs).

  EAGLE-3 taps HF `hidden_states[2], [L // 2], [L - 3]`; index 0 there is the
  embedding output, so these are decoder layers 1, L // 2 - 1 and L - 4.
  Tiny models clip and de-duplicate.
  """
  raw = (1, num_layers // 2 - 1, num_layers - 4)
  taps = sorted({min(max(t, 0), num_layers - 1) for t in raw})
  return tuple(taps)
