"""What each preset of `python -m infer.device_check` runs (no JAX here: the command sets
$XLA_FLAGS from the preset before the backend starts)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """The decode shape of the checks.

  Attributes:
    block_size: gamma, drafts per stage.
    max_stages: S_max of dloop.
    tree_budget: nodes per stage of the draft tree.
    prompt_length: the longest prompt (row 0 of every batch has this length,
      the others between half of it and it).
    new_tokens: greedy tokens per row of the f32 and tree runs.
    long_tokens: tokens per row of the bf16 runs, which the speed section
      times (`speed.in_loop`).
  """

  block_size: int
  max_stages: int
  tree_budget: int
  prompt_length: int
  new_tokens: int
  long_tokens: int

  @property
  def width(self) -> int:
    """The fixed width: a verification of every draft of S_max stages."""
    return 1 + self.max_stages * self.block_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """What a preset checks.

  Attributes:
    base: the `infer.profile` preset of the target's shape.
    overrides: its changed fields ("num_layers=4").
    shape: gamma, S_max, tree budget, prompt and output lengths.
    short_tokens: the shorter run of the in-loop timing; with
      `shape.long_tokens` and the prompt width both fall in one cache
      capacity bucket of `generate` (one compiled program).
    batches: batch sizes of every correctness comparison and of the speed
      (each one compiles every program again: the tiny preset runs one).
    prefill_lengths: prompt lengths of the prefill measurement.
    attention_lengths: prompt lengths of the attention comparison (cuDNN or
      its stand-in against XLA's path).
    long_contexts: prompt lengths the decode step is timed after.
    long_steps: (long, short) new tokens of the two runs timing a decode step
      after a long prompt.
    repeats: timed calls per measurement (the fastest or the median counts).
    drafter: drafter kind (random weights) of sd / dloop.
  """

  base: str
  overrides: str
  shape: Shape
  short_tokens: int
  batches: tuple[int, ...] = (1, 32)
  prefill_lengths: tuple[int, ...]
  attention_lengths: tuple[int, ...]
  long_contexts: tuple[int, ...]
  long_steps: tuple[int, int] = (48, 16)
  repeats: int
  drafter: str = "block"


PLANS = {
    # Qwen3-8B widths (D 4096, 32 / 8 heads of 128, MLP 12288, vocab 151936) with 4 of its 36
    # layers: every product the real model runs, at a ninth of its depth.
    "default": Plan(base="qwen3-8b", overrides="num_layers=4",
                    shape=Shape(block_size=4, max_stages=3, tree_budget=8, prompt_length=128,
                                new_tokens=48, long_tokens=370),
                    short_tokens=250, prefill_lengths=(1024, 8192, 32768),
                    attention_lengths=(8192, 32768), long_contexts=(8192, 32768), repeats=3),
    "tiny": Plan(base="tiny", overrides="",
                 shape=Shape(block_size=2, max_stages=2, tree_budget=4, prompt_length=16,
                             new_tokens=24, long_tokens=166),
                 short_tokens=120, batches=(4,), prefill_lengths=(64, 256),
                 attention_lengths=(640,), long_contexts=(64, 160), long_steps=(40, 16),
                 repeats=2),
}
# The tiny preset checks the command, not the compiler: its small programs compile about
# twice as fast with LLVM at optimisation level 0 and XLA:CPU's loop emitters (the test
# suite's flags), which it sets unless $XLA_FLAGS is set.
TINY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
