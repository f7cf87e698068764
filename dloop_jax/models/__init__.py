"""Target models: config, transformer, loaders (GGUF, HF safetensors), tokenizer."""

from dloop_jax.models.config import TransformerConfig
from dloop_jax.models.registry import LoadedTarget, load_target
from dloop_jax.models.transformer import Transformer

__all__ = ["LoadedTarget", "Transformer", "TransformerConfig", "load_target"]
