"""llama.cpp as a benchmark peer: the CPU engine a user would otherwise pick, on the same GGUF.

    peer   llama_cpp   llama.cpp (llama-cpp-python) token generation, greedy by default

An optional extra (`pip install -e '.[llama-cpp]'`, which builds llama.cpp from
source): without it the benchmark says so in one line and runs the other rows.

llama.cpp computes with the file's quantized weights (Q4_1 blocks for the
default target: 4-bit integer dot products), where our target and transformers
dequantize them to floats first. Its greedy tokens therefore follow slightly
different logits and may leave our `ar`'s; the benchmark reports how far they
agree instead of holding them to ar's tokens.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from dloop_jax.decoding import SamplingConfig
from dloop_jax.errors import ConfigError

from infer.bench import methods as methods_lib

NAME = "llama_cpp"
INSTALL = "pip install -e '.[llama-cpp]'"


def missing(source: str | os.PathLike) -> str | None:
  """Why the llama.cpp peer cannot run on `source` here (one line), or None when it can."""
  if not os.fspath(source).endswith(".gguf"):
    return (f"llama.cpp peer left out: it reads a .gguf file and the target is"
            f" {os.path.basename(os.fspath(source))!r}.")
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return (f"llama.cpp peer left out: llama-cpp-python is not installed ({INSTALL}, which"
            " builds llama.cpp from source; --peers without llama_cpp stops this line).")
  return None


def load(gguf_path: str | os.PathLike, *, threads: int, context: int) -> Any:
  """A `llama_cpp.Llama` of the GGUF file on `threads` CPU threads, `context` tokens of KV cache.

  Raises:
    ConfigError: `gguf_path` is no .gguf file, or llama-cpp-python is not installed.
  """
  if not os.fspath(gguf_path).endswith(".gguf"):
    raise ConfigError(f"The llama.cpp peer reads a .gguf file, got {os.fspath(gguf_path)!r}:"
                      " pass a .gguf --target, or leave llama_cpp out of --peers.")
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"The llama.cpp peer needs llama-cpp-python: {INSTALL} (builds llama.cpp"
                      " from source), or leave it out of --peers.") from e
  return llama_cpp.Llama(model_path=os.fspath(gguf_path), n_ctx=context, n_threads=threads,
                         n_threads_batch=threads, verbose=False)


@dataclasses.dataclass(kw_only=True)
class LlamaCppPeer:
  """llama.cpp generation from the prompt's token ids: greedy (temperature 0), or sampled."""

  model: Any  # llama_cpp.Llama
  max_new_tokens: int = 256
  sampling: SamplingConfig = SamplingConfig()
  stop_tokens: Sequence[int] = ()
  seed: int = 0

  method = label = method_name = NAME

  def run(self, prompt_ids: Sequence[int], **unused) -> methods_lib.Run:
    """The new tokens (a stop token included, as ours and transformers') and their wall time.

    The whole prompt is evaluated on every run, like the other methods: the
    model's state is reset first, so no prefix is reused from the last prompt.
    """
    del unused
    if self.sampling.greedy:
      options = dict(temp=0.0, top_k=1)
    else:
      self.model.set_seed(self.seed)
      options = dict(temp=self.sampling.temperature, top_k=self.sampling.top_k,
                     top_p=self.sampling.top_p)
    stops = set(self.stop_tokens)
    tokens = []
    self.model.reset()
    t0 = time.perf_counter()
    for token in self.model.generate(list(prompt_ids), min_p=0.0, typical_p=1.0,
                                     repeat_penalty=1.0, reset=True, **options):
      tokens.append(int(token))
      if token in stops or len(tokens) >= self.max_new_tokens:
        break
    seconds = time.perf_counter() - t0
    return methods_lib.Run(tokens=tokens, seconds=seconds)
