"""The methods a benchmark compares, behind one call: `method.run(prompt_ids) -> Run`.

    ours   ar                       dloop_jax generate(mode="ar")
           sd / dloop (per drafter) dloop_jax generate(mode=..., drafter=...), verifying the
                                    prefix of the drafts that pays (schedule="cost")
           sd/all, dloop/all        the same, verifying every draft (schedule="off")
           sd~prob, dloop~prob      the prefix that pays, scheduled from the top draft
                                    probabilities instead of a learned confidence
                                    (confidence="probability"; drafters with one)
           sd/treeB/all, ...        draft trees of B nodes per stage (tree_budget=B), verified
                                    whole ("/all") or their best nodes that pay (no "/all")
           sd+lookup, dloop/all+lookup, ...  prompt-lookup drafts where the drafter is unsure
                                    (lookup="prompt", greedy chains; `decoding.lookup`)
    peers  hf                       transformers (PyTorch) greedy generate()
           hf_pld                   transformers prompt-lookup decoding
                                    (generate(prompt_lookup_num_tokens=...))
           llama_cpp                llama.cpp on the GGUF's quantized weights, an optional
                                    extra (`llama_cpp_peer`)

The transformers peers run the same weights: transformers dequantizes the same
GGUF file; llama.cpp computes with its quantized blocks.
Our `seconds` exclude compilation (reported apart); the peers are warmed up
once before timing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from dloop_jax.decoding import DecodingConfig, GenerationOutput, RowStats, SamplingConfig
from dloop_jax.decoding import generate
from dloop_jax.errors import ConfigError

# The other engines' methods: their outputs are compared with our ar's and reported, not held
# to them (transformers' kernels round otherwise; llama.cpp computes with quantized weights).
PEERS = ("hf", "hf_pld", "llama_cpp")


@dataclasses.dataclass(kw_only=True)
class Run:
  """One prompt's result under one method.

  Attributes:
    tokens: the new tokens.
    seconds: wall time of the decode (compilation excluded).
    compile_seconds: time spent compiling in this run (ours).
    stats: our engine's statistics of the row (`RowStats`); None for a peer,
      which counts no rounds and no forwards.
  """

  tokens: list[int]
  seconds: float
  compile_seconds: float = 0.0
  stats: RowStats | None = None

  @classmethod
  def of(cls, out: GenerationOutput) -> "Run":
    """The run of a one-row `generate()` output."""
    return cls(tokens=out.tokens[0], seconds=out.seconds, compile_seconds=out.compile_seconds,
               stats=out.rows[0])

  def record(self) -> dict:
    """The statistics a benchmark record holds: `RowStats.as_dict()`'s keys, zeros for a
    peer (no target forward counted: its modeled speed is not reported)."""
    if self.stats is not None:
      return self.stats.as_dict()
    zero = RowStats(new_tokens=len(self.tokens), rounds=0, committed_in_rounds=0).as_dict()
    return dict(zero, target_forwards=0)


@dataclasses.dataclass(kw_only=True)
class Ours:
  """A mode of our `generate()` (with a drafter for sd / dloop), decoding by `decoding`."""

  decoding: DecodingConfig  # the mode and every option, as `generate(config=)` takes them
  target: Any  # Transformer
  drafter: Any = None
  drafter_label: str = ""
  max_new_tokens: int = 256
  stop_tokens: Sequence[int] = ()
  seed: int = 0
  weights: str = ""  # the target's weight storage when not the run's reference ("bf16"); "": it

  @property
  def method(self) -> str:
    """"ar", "sd" or "dloop"."""
    return self.decoding.mode

  @property
  def tree_budget(self) -> int:
    return self.decoding.tree_budget

  @property
  def fixed_width(self) -> int:
    return self.decoding.fixed_width or 0

  @property
  def costs(self) -> Any:
    return self.decoding.costs

  @property
  def method_name(self) -> str:
    """The method as reported: the mode, "/treeB" with trees, "/all" when every draft is
    verified, "~prob" when the scheduler reads the top draft probabilities of a drafter that
    has a learned confidence, "+lookup" with the prompt-lookup stage, "/wW" at a fixed
    forward width W, "@bf16" on a target whose
    weights are stored otherwise than the run's reference `ar`'s, "~inexact" for a 16-bit
    target at free widths (`generate(allow_inexact=)`: reported, not held to ar's tokens)."""
    c = self.decoding
    width = f"/w{self.fixed_width}" if self.fixed_width else ""
    width += "~inexact" if c.allow_inexact and self.method != "ar" else ""
    weights = f"@{self.weights}" if self.weights else ""
    if self.method == "ar":
      return self.method + width + weights
    name = self.method + (f"/tree{self.tree_budget}" if self.tree_budget else "")
    name = f"{name}/all" if c.schedule == "off" else name
    if c.confidence == "probability":
      name += "~prob"
    if c.lookup == "prompt":
      name += "+lookup"
    return name + width + weights

  @property
  def label(self) -> str:
    name = self.method_name
    return name if not self.drafter_label else f"{name}[{self.drafter_label}]"

  def run(self, prompt_ids: Sequence[int], **changes: Any) -> Run:
    """One prompt decoded; `changes` are fields of the config for this run (a sweep's gate)."""
    out = generate(
        self.target, [list(prompt_ids)], max_new_tokens=self.max_new_tokens,
        config=self.decoding.replace(**changes),
        drafter=self.drafter if self.method != "ar" else None, seed=self.seed,
        stop_tokens=self.stop_tokens)
    return Run.of(out)


def load_hf_reference(gguf_path: str, *, threads: int | None = None):
  """transformers (PyTorch, f32) model of the same GGUF file."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError("The transformers peers need PyTorch: pip install -e '.[test]' (or"
                      " torch==2.13.0), or leave them out with --no-peers.") from e
  torch.set_num_threads(threads or os.cpu_count() or 1)
  folder, name = os.path.split(os.fspath(gguf_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32)
  return model.eval()


@dataclasses.dataclass(kw_only=True)
class HFPeer:
  """transformers `generate()` on the same weights: greedy, or prompt lookup."""

  model: Any
  prompt_lookup: int = 0  # > 0: prompt-lookup decoding with this many draft tokens
  max_new_tokens: int = 256
  sampling: SamplingConfig = SamplingConfig()
  stop_tokens: Sequence[int] = ()
  pad_token_id: int = 0
  seed: int = 0

  @property
  def method(self) -> str:
    return "hf_pld" if self.prompt_lookup else "hf"

  label = method_name = method

  def run(self, prompt_ids: Sequence[int], **unused) -> Run:
    import torch  # pylint: disable=g-import-not-at-top
    del unused
    kwargs: dict[str, Any] = dict(max_new_tokens=self.max_new_tokens,
                                  eos_token_id=list(self.stop_tokens) or None,
                                  pad_token_id=self.pad_token_id)
    if self.sampling.greedy:
      kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
      torch.manual_seed(self.seed)
      kwargs.update(do_sample=True, temperature=self.sampling.temperature,
                    top_p=self.sampling.top_p, top_k=self.sampling.top_k or None)
    if self.prompt_lookup:
      kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
    ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
      t0 = time.perf_counter()
      out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
      seconds = time.perf_counter() - t0
    return Run(tokens=out[0, ids.shape[1]:].tolist(), seconds=seconds)


def timed_run(method, prompt_ids: Sequence[int], **kwargs) -> Run:
  """`method.run`, timed warm: a run that compiled (a new shape bucket) is repeated.

  The first execution of a freshly compiled program runs cold (slower per
  step), a cost the peers, warmed up once, do not pay per prompt
  shape. The repeat gives the same tokens; its time is recorded, and the
  compile time of the first run.
  """
  run = method.run(prompt_ids, **kwargs)
  if run.compile_seconds:
    run = dataclasses.replace(method.run(prompt_ids, **kwargs),
                              compile_seconds=run.compile_seconds)
  return run


def interleaved_runs(methods: Sequence[Any], prompt_ids: Sequence[int], *, repeats: int = 1,
                     rotation: int = 0) -> dict[int, Run]:
  """Each method's `timed_run` on one prompt, `repeats` times, the methods interleaved.

  Pass r runs the methods starting from the (rotation + r)-th, so slow drift of
  the machine falls on every method alike; each method keeps its run of median
  time (the lower median for an even count). Keyed by `id(method)`.
  """
  if repeats < 1:
    raise ConfigError(f"repeats must be >= 1, got {repeats}.")
  runs: dict[int, list[Run]] = {id(m): [] for m in methods}
  for r in range(repeats):
    k = (rotation + r) % len(methods)
    for m in list(methods[k:]) + list(methods[:k]):
      runs[id(m)].append(timed_run(m, prompt_ids))
  return {key: sorted(rs, key=lambda run: run.seconds)[(len(rs) - 1) // 2]
          for key, rs in runs.items()}
