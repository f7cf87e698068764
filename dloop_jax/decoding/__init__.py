"""Decoding: `generate()` in modes ar / sd / dloop, sampling, acceptance, stats."""

from dloop_jax.decoding.config import DecodingConfig
from dloop_jax.decoding.engine import MODES, clear_compiled, generate, trace_count
from dloop_jax.decoding.sampling import GREEDY, SamplingConfig
from dloop_jax.decoding.stats import GenerationOutput, RowStats

__all__ = ["DecodingConfig", "MODES", "clear_compiled", "generate", "trace_count", "GREEDY", "SamplingConfig",
           "GenerationOutput", "RowStats"]
