"""`generate()`: prefill, then a `lax.while_loop` over rounds, as one jit.

Modes:
  ar     one target forward per new token.
  sd     standard speculative decoding: one drafting stage of gamma tokens,
         then one verification (planned as dloop with S_max = 1).
  dloop  DLoop: another stage while the drafter's confidence in the stage just
         drafted is at least the gate g (at most S_max stages), then ONE
         verification of all drafts.

A call is planned once (`plan.make`: the config resolved, the static `Plan`
and the traced `Inputs`), and the program is `decode_loop.DecodeLoop` over
them: per round, a proposer drafts (`chain_round`: gated chains with the
prompt lookup; `tree_round`: draft trees), the scheduler chooses what to
verify (`schedule`), one target forward verifies it, and the loop commits
the accepted tokens.

With `fixed_width=W` every target forward after prefill is W tokens wide
(plain steps padded, every draft verified), so that all modes at one W give
bit-identical greedy outputs in any weight dtype (docs/decoding.md).

A Python-side cache keyed by the `Plan` (model structure, shapes, S_max,
gamma, widths, sampling, stop-token slots) holds the compiled executables, so
a second call with the same shapes runs without tracing or compiling. The
gate g, the cost table, the back-off and the source of the scheduler's
confidences (`confidence=`) are traced arrays: sweeping them does not
recompile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from dloop_jax import compilation_cache
from dloop_jax.decoding import arguments
from dloop_jax.decoding import config as config_lib
from dloop_jax.decoding import plan as plan_lib
from dloop_jax.decoding import stats as stats_lib
from dloop_jax.decoding.config import DecodingConfig
from dloop_jax.decoding.decode_loop import DecodeLoop
from dloop_jax.decoding.drafter import Drafter
from dloop_jax.decoding.stats import GenerationOutput
from dloop_jax.errors import ConfigError
from dloop_jax.models import attention_kernels
from dloop_jax.models import cpu_kernels
from dloop_jax.models.registry import LoadedTarget
from dloop_jax.models.transformer import Transformer


MODES = arguments.MODES


_TRACE_COUNT = 0
_COMPILED: dict[plan_lib.Plan, Any] = {}
# The library attention kernels the last trace of each plan's program called
# (`attention_kernels.recording`): the program a cached trace or executable
# runs is the one that trace made.
_KERNELS: dict[plan_lib.Plan, tuple[str, ...]] = {}


def trace_count() -> int:
  """How many times a decode program has been traced (and so compiled)."""
  return _TRACE_COUNT


def _decode(plan: plan_lib.Plan, target_state, drafter_params, inputs: plan_lib.Inputs):
  """The whole generation as one traced program."""
  global _TRACE_COUNT
  _TRACE_COUNT += 1
  target: Transformer = nnx.merge(plan.target_graph, target_state)
  drafter: Drafter | None = (nnx.merge(plan.drafter_graph, drafter_params)
                             if plan.drafter_graph is not None else None)
  with attention_kernels.recording() as kernels:
    lp = DecodeLoop(plan=plan, target=target, drafter=drafter, inputs=inputs).run()
  _KERNELS[plan] = tuple(sorted(kernels))
  return lp.out, lp.num_new, lp.stats, lp.features


def clear_compiled() -> None:
  """Frees every program `generate()` has compiled (one per mode and shape bucket).

  Each compiled XLA:CPU program holds its own memory mappings; a process that
  compiles hundreds of shapes (a sweep over many configurations, a test suite)
  can reach the kernel's per-process limit (`vm.max_map_count`), where XLA
  aborts. The next call of a shape compiles it again. JAX's own caches hold
  the same executables, so they are cleared too (`jax.clear_caches()`: other
  jitted functions recompile on their next call as well).
  """
  _COMPILED.clear()
  _KERNELS.clear()
  jax.clear_caches()


def _matmul_precision(target: Transformer):
  """The context a decode program is lowered in: f32 products at full precision.

  GPUs multiply f32 matrices in TF32 and TPUs in bf16 passes by default, far
  from what an f32 target promises (outputs equal `ar`'s up to near-ties of
  ~1e-3); a 16-bit target's products are 16-bit anyway, and a CPU's f32
  products are full precision already.
  """
  if jax.default_backend() == "cpu" or arguments.is_16_bit(target):
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")


def _kernel_forms(target: Transformer):
  """The product forms of the whole program, drafter included: the target's
  (`models.cpu_kernels`)."""
  return cpu_kernels.use(cpu_kernels.resolve(target.cpu_kernels))


@contextlib.contextmanager
def program_context(target: Transformer):
  """The context a program computing with `target` is traced and compiled in: the
  engine's f32 precision and the target's product forms (`generate()`'s, and what a
  measurement of the engine's numbers must use too)."""
  with _matmul_precision(target), _kernel_forms(target):
    yield


def _split_options(config: DecodingConfig | None, kwargs: dict) -> tuple[DecodingConfig, dict]:
  """(the config with the keyword overrides that name its fields, the other keywords)."""
  overrides = {k: v for k, v in kwargs.items() if k in config_lib.FIELDS}
  rest = {k: v for k, v in kwargs.items() if k not in config_lib.FIELDS}
  unknown = sorted(set(rest) - _CALL_OPTIONS)
  if unknown:
    raise ConfigError(f"generate() got unknown option(s) {unknown}; decoding options are"
                      f" {sorted(config_lib.FIELDS)} (or pass config=DecodingConfig(...)), call"
                      f" options {sorted(_CALL_OPTIONS)}.")
  return (config if config is not None else DecodingConfig()).replace(**overrides), rest


_CALL_OPTIONS = frozenset({"drafter", "seed", "stop_tokens", "capture_taps", "grow_cache"})


def decode_jaxpr(target: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 config: DecodingConfig | None = None, **kwargs):
  """The jaxpr of the program `generate()` would run (for inspection and tests)."""
  config, rest = _split_options(config, kwargs)
  plan, _, args = plan_lib.make(target, prompts, config=config, max_new_tokens=max_new_tokens,
                                **rest)
  with _kernel_forms(target):
    return jax.make_jaxpr(lambda *a: _decode(plan, *a))(*args)


def lower(target: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
          config: DecodingConfig | None = None, **kwargs) -> tuple[Any, plan_lib.Plan]:
  """(the lowered program `generate()` would compile for these arguments, its plan): for
  measuring compile time and program size (`infer.bench.compile_size`)."""
  config, rest = _split_options(config, kwargs)
  plan, _, args = plan_lib.make(target, prompts, config=config, max_new_tokens=max_new_tokens,
                                **rest)
  with program_context(target):
    return jax.jit(_decode, static_argnums=0).lower(plan, *args), plan


def _compiled(plan: plan_lib.Plan, args: tuple, *, target: Transformer) -> tuple[Any, float]:
  """(the program of `plan`, compiled now or before; the seconds its compile took, 0 if
  it was compiled before)."""
  compiled = _COMPILED.get(plan)
  if compiled is not None:
    return compiled, 0.0
  compilation_cache.ensure()
  t0 = time.perf_counter()
  with program_context(target):
    compiled = jax.jit(_decode, static_argnums=0).lower(plan, *args).compile()
  _COMPILED[plan] = compiled
  return compiled, time.perf_counter() - t0


def decode_program(target: Transformer, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, config: DecodingConfig | None = None, **kwargs):
  """(the compiled program `generate()` runs for these arguments, its plan): for
  inspecting the optimized program (`decoding.loop_copies`); compiled once, shared with
  `generate()`."""
  config, rest = _split_options(config, kwargs)
  plan, _, args = plan_lib.make(target, prompts, config=config, max_new_tokens=max_new_tokens,
                                **rest)
  return _compiled(plan, args, target=target)[0], plan


def generate(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    config: DecodingConfig | None = None,
    seed: int | jax.Array = 0,
    stop_tokens: Sequence[int] = (),
    capture_taps: Sequence[int] = (),
    grow_cache: bool = False,
    **options: Any,
) -> GenerationOutput:
  """Generates continuations of a batch of token-id prompts.

  Args:
    target: the target model (a `Transformer`, or the `LoadedTarget` that
      `load_target` returns). One placed on a device mesh (`load_target(...,
      mesh=)`) decodes there: rows over the mesh's data axis (B must be a
      multiple of its size), weights and KV heads as placed (docs/scaling.md).
    prompts: B prompts (lists of token ids, lengths may differ).
    max_new_tokens: new tokens per row at most (the first comes from prefill).
    drafter: drafter for "sd" / "dloop".
    config: a `DecodingConfig` holding the decoding options below (mode
      through allow_inexact); None: the defaults. Keyword options given as
      well override its fields: `generate(..., config=c, gate=-1.0)`.
    seed: int or PRNG key.
    stop_tokens: token ids that end a row (committed, then the row stops).
    capture_taps: ("ar" only) also return the target's tapped hidden states at
      every position read during generation.
    grow_cache: ("ar" only) start the KV cache just past the prompts and grow
      it in steps (`cache_ladder`), so that each step attends over about the
      live context instead of the whole capacity: faster long generations
      (dataset builds), a longer compile. Same tokens and taps up to
      floating-point summation order.
    **options: fields of `DecodingConfig`:

    mode: "ar", "sd" or "dloop".
    block_size: gamma, drafts per stage (default: the drafter's own).
    gate: DLoop's confidence gate g (only "dloop").
    max_stages: S_max (only "dloop"; "sd" always drafts one stage). None: 3,
      or what the fixed width holds (below).
    sampling: greedy by default.
    schedule: ("sd" / "dloop") "cost": verify only the prefix of the drafts
      whose expected committed tokens per unit of target time is best (see
      `decoding.schedule`; possibly none: a plain decode step); "off": verify
      every draft. None: "cost" for chains, "off" for trees. With a
      tree_budget, "cost" verifies the best b nodes of the tree by path
      score (`decoding.tree_round`).
    costs: with schedule="cost", the target forward's cost per width: a
      `costs.CostTable`, a {width: cost} mapping or a JSON file path. None: the
      file named by $DLOOP_COSTS if set, else this target's table on this
      machine at this batch size if one was measured (`python -m infer.costs`),
      else the profile's default table (with a warning). "calibrate": that
      table, measured and cached on disk first if missing (`decoding.costs`).
      The table is a traced value: changing it does not recompile.
    draft_backoff: ("sd" / "dloop") the longest pause, in rounds, of a row's
      drafting after rounds whose drafts were all rejected or not worth
      verifying (`decoding.draft_policy`: pauses double from 1 up to this;
      rounds in a pause are plain decode steps); 0 drafts every round. None:
      `config.DEFAULT_DRAFT_BACKOFF` with schedule="cost", else 0 (fixed widths too). A traced
      value: changing it does not recompile.
    lookup: ("sd" / "dloop", greedy chains) "prompt": where the newest
      `lookup_min_match`..3 tokens of a row occurred earlier in its prompt or
      output and the drafter's first draft has probability below
      `lookup_max_probability`, the round verifies the tokens that followed
      that occurrence instead of the drafter's stages (`decoding.lookup`;
      counted in `RowStats.lookup_rounds`); "off": the drafter's; "auto"
      (default): "prompt" for greedy chains of sd / dloop, "off" elsewhere.
    tree_budget: ("sd" / "dloop") B > 0 drafts a tree of the B best prefixes
      per stage (DDTree) and verifies the whole tree in one target forward
      (`decoding.tree_round`; drafters with `supports_trees`); 0: chains.
    confidence: (schedule="cost") where the scheduler's c_k come from:
      "drafter", the drafter's learned confidence (`Drafter.has_confidence`:
      DSpark's confidence head); "probability", the drafter's top draft
      probability (`schedule.draft_confidence`); "auto" (default), the first
      when the drafter has one. A traced value: switching does not recompile.
    fixed_width: W > 0 runs every target forward after prefill at width W:
      decode steps padded to W tokens, verifications of every draft padded to
      W (W >= 1 + max_stages * block_size; schedule "off"; chains only).
      Every forward is then the same program shape, in which XLA computes a
      token's row with the same bits wherever it sits, so greedy outputs of
      all modes run with the same W are bit-identical, with 16-bit weights
      and compute too. 0: each forward as wide as its tokens. None (default):
      the profile's width for a 16-bit target's chains (cpu 5, gpu / tpu 16;
      dloop then drafts the loop it verifies whole, 2 stages of 2 at W = 5,
      unless block_size / max_stages say otherwise, which widen W in every
      mode alike), 0 for f32 targets and trees (`arguments.resolve_shape`).
    profile: "cpu", "gpu", "tpu" or None (this backend's, `dloop_jax.profiles`):
      the defaults above.
    allow_inexact: run a 16-bit target's sd / dloop at free widths (trees,
      fixed_width=0, schedule="cost"), where greedy outputs equal `ar`'s
      only up to 16-bit rounding (`arguments.validate_exactness`); without it
      such a call raises a ConfigError naming the exact alternatives.

  Returns:
    A `GenerationOutput` with the new tokens and statistics of every row.
  """
  if isinstance(target, LoadedTarget):
    target = target.model
  config, _ = _split_options(config, options)
  plan, config, args = plan_lib.make(
      target, prompts, config=config, max_new_tokens=max_new_tokens, drafter=drafter,
      seed=seed, stop_tokens=stop_tokens, capture_taps=capture_taps, grow_cache=grow_cache)
  prompts = [list(p) for p in prompts]
  compiled, compile_seconds = _compiled(plan, args, target=target)
  t0 = time.perf_counter()
  out, num_new, stats, features = compiled(*args)
  out = np.asarray(jax.device_get(out))
  seconds = time.perf_counter() - t0
  num_new = np.asarray(num_new)
  rows = stats_lib.to_rows(stats, num_new, speculative=plan.speculative)
  feats = None
  if capture_taps:
    feats_np = np.asarray(features)
    # Positions read by the target: the prompt and every new token but the last.
    feats = [feats_np[i, :len(prompts[i]) + int(num_new[i]) - 1] for i in range(len(prompts))]
  mode, gate = config.mode, config.gate
  if mode == "dloop" and gate != arguments.AUTO_GATE:
    gate = float(gate)
  speculative = plan.speculative
  return GenerationOutput(
      tokens=[out[i, :int(num_new[i])].tolist() for i in range(len(prompts))],
      rows=rows, seconds=seconds, compile_seconds=compile_seconds, mode=mode,
      block_size=plan.block_size or None, gate=gate if mode == "dloop" else None,
      max_stages=plan.max_stages if speculative else None,
      schedule=plan.schedule if speculative else None, features=feats,
      fixed_width=plan.fixed_width or None, widths=plan.widths,
      attention_kernels=_KERNELS.get(plan, ()))
