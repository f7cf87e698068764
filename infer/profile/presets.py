"""Target shapes to profile, whether they fit the device, and random-weight targets of them.

Presets copy the architecture of public checkpoints (their config.json) without
their weights: timing does not depend on the values, so random weights at the
right shapes measure what the real model would cost.

    qwen3-4b   Qwen3-4B: 36 layers, D 2560, 32 / 8 heads of 128, MLP 9728,
               vocab 151936, tied embeddings, q/k RMSNorm; bf16
    qwen3-8b   Qwen3-8B: 36 layers, D 4096, 32 / 8 heads of 128, MLP 12288,
               vocab 151936, untied; bf16
    tiny       the test suite's tiny shape as a Qwen3 (2 layers, D 32, vocab 64); f32

`overrides` ("num_layers=4,vocab_size=32000") change any `TransformerConfig`
field of a preset, e.g. to fit a smaller device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from dloop_jax.errors import ConfigError
from dloop_jax.models import int8 as int8_lib
from dloop_jax.models.config import TransformerConfig, tiny_config
from dloop_jax.models.registry import weight_dtype
from dloop_jax.models.transformer import SCALE_SUFFIX, Transformer

_QWEN3 = dict(family="qwen3", qk_norm=True, vocab_size=151936, num_layers=36, num_heads=32,
              num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
              max_position_embeddings=40960, bos_token_id=None, eos_token_ids=(151645,))

# name -> (config, default activation dtype)
PRESETS: dict[str, tuple[TransformerConfig, str]] = {
    "qwen3-4b": (TransformerConfig(**_QWEN3, hidden_size=2560, intermediate_size=9728,
                                   tie_embeddings=True, name="qwen3-4b (random weights)"),
                 "bfloat16"),
    "qwen3-8b": (TransformerConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288,
                                   tie_embeddings=False, name="qwen3-8b (random weights)"),
                 "bfloat16"),
    "tiny": (tiny_config(family="qwen3", qk_norm=True, name="tiny (random weights)"), "float32"),
}

DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16}


def preset_config(name: str, overrides: str = "") -> tuple[TransformerConfig, str]:
  """The config of preset `name` with "field=value,..." `overrides`, and its default dtype.

  Raises:
    ConfigError: unknown preset, unknown field or a value of the wrong type.
  """
  if name not in PRESETS:
    raise ConfigError(f"Unknown preset {name!r}; known presets: {', '.join(PRESETS)}. Other"
                      " shapes: a preset with --set field=value,... (any TransformerConfig field).")
  config, dtype = PRESETS[name]
  changes = {}
  fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
  settable = sorted(k for k, f in fields.items() if f.type in ("int", "float", "bool", "str"))
  for item in (s.strip() for s in overrides.split(",")):
    if not item:
      continue
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in settable:
      raise ConfigError(f"--set takes field=value pairs of {settable}; got {item!r}.")
    kind = fields[key].type
    try:
      if kind == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
          raise ValueError(value)
        changes[key] = value.lower() in ("true", "1")
      else:
        changes[key] = {"int": int, "float": float, "str": str}[kind](value)
    except ValueError:
      raise ConfigError(f"--set {key} needs a {kind}, got {value!r}.") from None
  return dataclasses.replace(config, **changes), dtype


def parse_dtype(name: str):
  if name not in DTYPES:
    raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}.")
  return jnp.dtype(DTYPES[name])


def device_memory_bytes() -> int | None:
  """Memory of the first device (accelerators: the allocator's limit; CPU: physical RAM)."""
  device = jax.devices()[0]
  try:
    stats = device.memory_stats() or {}
  except (AttributeError, NotImplementedError, RuntimeError):
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if jax.default_backend() == "cpu":
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
  return None


def memory_estimate(config: TransformerConfig, *, dtype, weights, batch_size: int,
                    capacity: int) -> dict[str, int]:
  """Bytes the profile holds on the device: target weights, KV caches, drafters (about).

  Drafters are bounded by a quarter of the target (a few layers plus heads over
  the vocabulary); activations of a forward of <= 65 tokens are small next to
  these at batch sizes a decode uses.
  """
  act = jnp.dtype(dtype).itemsize
  weights_bytes = config.num_params() * jnp.dtype(weights).itemsize
  # Target KV cache, the calibration cache and the generation's, each
  # [layers, batch, capacity, kv heads, head dim] keys and values.
  cache = 2 * config.num_layers * batch_size * capacity * config.kv_size * act
  return dict(weights=weights_bytes, caches=2 * cache, drafters=weights_bytes // 4,
              total=weights_bytes + 2 * cache + weights_bytes // 4)


def check_fits(config: TransformerConfig, *, dtype, weights, batch_size: int, capacity: int,
               available: int | None, preset: str) -> dict[str, int]:
  """`memory_estimate`, after checking it fits in `available` bytes (None: unknown, not checked).

  Raises:
    ConfigError: it does not fit; says how much it needs and what to change.
  """
  need = memory_estimate(config, dtype=dtype, weights=weights, batch_size=batch_size,
                         capacity=capacity)
  if available is not None and need["total"] > 0.9 * available:
    gib = 2 ** 30
    raise ConfigError(
        f"{preset} in {jnp.dtype(weights).name} needs about {need['total'] / gib:.1f} GiB"
        f" (weights {need['weights'] / gib:.1f}, KV caches {need['caches'] / gib:.1f}, drafters"
        f" {need['drafters'] / gib:.1f}) but the device ({jax.devices()[0].device_kind}) has"
        f" {available / gib:.1f} GiB. Use a smaller preset (qwen3-4b, tiny), fewer layers"
        " (--set num_layers=N: costs scale with layers), bf16 weights (--weights bf16), a"
        " smaller --batch-size, or a device with more memory.")
  return need


# Random matrices: normal(_STD); int8 codes normal(_CODE_STD) (4 deviations within the
# codes' 127), scaled by _STD / _CODE_STD.
_STD = 0.02
_CODE_STD = 32.0


def random_target(config: TransformerConfig, *, dtype, weights, seed: int = 0,
                  cpu_kernels: bool | None = None) -> Transformer:
  """A target of `config` with random weights, built leaf by leaf on the device.

  The constructor would draw every layer's weights stacked and then split
  them (twice the memory); here each parameter is drawn once, in its own
  dtype: normal(0.02) matrices, unit norms (timing does not depend on values,
  but NaNs or denormals would). Int8 matrices get codes of a normal of 32
  codes' deviation and scales of 0.02 / 32, so that they too stand for
  normal(0.02) matrices (`models.int8`). `cpu_kernels` as `Transformer`'s
  (None: this backend's product forms).
  """
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                weight_dtype=weights, cpu_kernels=cpu_kernels))
  graph, state = nnx.split(abstract)
  key = jax.random.key(seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      values.append(jnp.ones(leaf.shape, leaf.dtype))
    elif int8_lib.is_int8(leaf.dtype):
      values.append(_codes(jax.random.fold_in(key, i), leaf.shape))
    elif SCALE_SUFFIX in name:
      values.append(jnp.full(leaf.shape, _STD / _CODE_STD, leaf.dtype))
    else:
      values.append(_normal(jax.random.fold_in(key, i), leaf.shape, leaf.dtype))
  return nnx.merge(graph, jax.tree_util.tree_unflatten(treedef, values))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
  return (_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _codes(key, shape):
  codes = jnp.round(_CODE_STD * jax.random.normal(key, shape, jnp.float32))
  return jnp.clip(codes, -int8_lib.LEVELS, int8_lib.LEVELS).astype(int8_lib.DTYPE)


def is_out_of_memory(e: Exception) -> bool:
  """Whether `e` is the device running out of memory (compiling or running)."""
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def summary(config: TransformerConfig) -> Mapping[str, object]:
  """The shape fields a report shows."""
  keys = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "qk_norm", "tie_embeddings")
  out = {k: getattr(config, k) for k in keys}
  out["params"] = int(config.num_params())
  return out


def resolve_weights(name: str | None, dtype):
  """--weights (None: the activation dtype)."""
  return weight_dtype(name, default=dtype)


