"""Per-width cost of a target forward on this machine: what the scheduler trades against.

A `CostTable` maps a forward's width (tokens per row) to its time in
milliseconds. On an accelerator it is almost flat; on a CPU it is steep (a
5-token forward ~1.7x a 1-token one), and the same scheduler must do the right
thing on both, so the table is measured, not assumed:

  * `calibrate`: times jitted target forwards of widths 1, 2, 3, 5, 9, 13, 17
    (median of a few interleaved repeats) against a half-full cache of a
    realistic capacity (512 slots, or the context window if shorter), reading
    the cache as the verification branches do.
  * `for_target`: the table of a target at a batch size, calibrated the first
    time and cached on disk as JSON under `$DLOOP_CACHE_DIR/costs/` (default
    `~/.cache/dloop_jax/costs/`), keyed by the target's config, weight dtypes,
    jax version, backend / device kind (processor and core count on a CPU) and
    batch size. A table that lacks a width a program needs is extended.
  * overrides: `generate(costs=...)` takes a `CostTable`, a mapping
    {width: cost}, or the path of a JSON file (`save` writes one; the file
    needs a "costs" object {"width": cost}); with `costs=None` the file named
    by `$DLOOP_COSTS` is used if set, else the table `for_target` cached,
    else the profile's default table (`DEFAULT_TABLES`, with a warning):
    `generate()` measures only when asked, with `costs="calibrate"`.

Widths between measured ones are interpolated linearly; a table must measure
width 1 and at least the widest width a program verifies.

    python -m infer.costs                  # print the default target's table
    python -m infer.costs --recalibrate    # measure again
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
import os
import platform
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dloop_jax import json_files
from dloop_jax import profiles
from dloop_jax.errors import ConfigError

DEFAULT_WIDTHS = (1, 2, 3, 5, 9, 13, 17)
FORMAT = "dloop_jax.costs/1"
# The cache length of a calibration: verification reads the whole cache, so its
# cost grows with the capacity; 512 slots is a typical chat turn.
CALIBRATION_CAPACITY = 512

_MEMO: dict[str, "CostTable"] = {}


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Target forward cost per width.

  Attributes:
    costs: {width: milliseconds} (any positive unit works for the scheduler,
      which only compares ratios), width >= 1.
    key: what the table was measured for (target, dtypes, machine, batch).
  """

  costs: Mapping[int, float]
  key: Mapping[str, Any] | None = None

  def __post_init__(self):
    if not isinstance(self.costs, Mapping) or not self.costs:
      raise ConfigError("A cost table needs at least one {width: cost} entry.")
    clean = {}
    for w, c in self.costs.items():
      try:
        width = int(w)
      except (TypeError, ValueError):
        raise ConfigError(f"Cost table widths must be integers >= 1, got {w!r}.") from None
      if width < 1 or str(width) != str(w).strip():
        raise ConfigError(f"Cost table widths must be integers >= 1, got {w!r}.")
      if (isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c)
          or c <= 0):
        raise ConfigError(f"Cost table entry for width {width} must be a positive finite number,"
                          f" got {c!r}.")
      clean[width] = float(c)
    object.__setattr__(self, "costs", dict(sorted(clean.items())))

  @property
  def widths(self) -> tuple[int, ...]:
    return tuple(self.costs)

  def at(self, widths: Sequence[int]) -> np.ndarray:
    """Costs at `widths` (linear interpolation between measured widths).

    Raises:
      ConfigError: width 1 is not measured, or a width is past the widest measured.
    """
    measured = self.widths
    if measured[0] != 1:
      raise ConfigError(f"The cost table measures widths {list(measured)} but not width 1 (the"
                        " plain decode step); add it.")
    too_wide = [w for w in widths if w > measured[-1]]
    if too_wide:
      raise ConfigError(
          f"The cost table measures widths up to {measured[-1]}, but widths {too_wide} are"
          " verified; measure them (python -m infer.costs --recalibrate --widths ...) or pass"
          " a wider table.")
    return np.interp(np.asarray(widths, np.float64), measured,
                     [self.costs[w] for w in measured]).astype(np.float32)

  def to_json(self) -> dict:
    return {"format": FORMAT, "unit": "ms", "key": dict(self.key or {}),
            "costs": {str(w): c for w, c in self.costs.items()}}

  def save(self, path: str | os.PathLike) -> str:
    """Writes the table as JSON (the format `load` reads); returns the path."""
    return json_files.write_json(path, self.to_json(), default=str)

  def format(self) -> str:
    """A readable table: width, ms, and the ratio to a 1-token forward."""
    one = self.costs.get(1)
    lines = ["width  ms       x width 1"]
    for w, c in self.costs.items():
      ratio = f"{c / one:.2f}" if one else "-"
      lines.append(f"{w:>5}  {c:>7.2f}  {ratio}")
    return "\n".join(lines)


def median_ms(calls: Mapping[Any, Any], *, repeats: int) -> dict[Any, float]:
  """Median milliseconds of each of `calls` ({name: () -> array}), after one warm-up call
  each (compiles); the repeats go round-robin over the calls, so slow drift of the
  machine spreads over all of them."""
  for call in calls.values():
    call().block_until_ready()
  times: dict[Any, list[float]] = {name: [] for name in calls}
  for _ in range(max(1, repeats)):
    for name, call in calls.items():
      t0 = time.perf_counter()
      call().block_until_ready()
      times[name].append((time.perf_counter() - t0) * 1e3)
  return {name: statistics.median(t) for name, t in times.items()}


def load(path: str | os.PathLike) -> CostTable:
  """Reads a cost table JSON file ({"costs": {"1": 30.0, "2": 40.4, ...}, ...}).

  Raises:
    ConfigError: the file is missing, not JSON, or not a cost table.
  """
  path = os.fspath(path)
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    raise ConfigError(f"Cannot read cost table {path}: {e.strerror or e}.") from e
  except json.JSONDecodeError as e:
    raise ConfigError(f"Cost table {path} is not valid JSON: {e}.") from e
  if not isinstance(data, dict) or not isinstance(data.get("costs"), dict):
    raise ConfigError(f"Cost table {path} needs a \"costs\" object mapping widths to"
                      " milliseconds, e.g. {\"costs\": {\"1\": 30.0, \"5\": 51.7}}.")
  try:
    return CostTable(costs=data["costs"], key=data.get("key"))
  except ConfigError as e:
    raise ConfigError(f"Cost table {path}: {e}") from None


cache_dir = profiles.cache_dir


def _weight_dtypes(target) -> list[str]:
  return sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(target))})


def cache_key(target, *, batch_size: int) -> dict:
  """What a table depends on: target config, weights' dtypes and layout, software, machine, batch."""
  config = json.dumps(dataclasses.asdict(target.config), sort_keys=True, default=str)
  device = jax.devices()[0]
  key = dict(target=getattr(target.config, "name", "") or "",
             config=hashlib.sha256(config.encode()).hexdigest()[:16],
             weights=_weight_dtypes(target),
             matrices="out_major" if getattr(target, "out_major", False) else "in_major",
             jax=jax.__version__, backend=jax.default_backend(),
             device_kind=device.device_kind, batch_size=int(batch_size),
             capacity=_capacity(target))
  if getattr(target, "mesh", None) is not None:
    key.update(mesh=dict(target.mesh.shape))
  if jax.default_backend() == "cpu":
    key.update(processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
  return key


def _capacity(target) -> int:
  return min(CALIBRATION_CAPACITY, target.config.max_position_embeddings)


def _path(key: Mapping[str, Any], directory: str | None) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  return os.path.join(directory or cache_dir(), "costs", f"{digest}.json")


@functools.partial(jax.jit, static_argnums=0)
def _forward(graph, state, tokens, cache):
  """A verification-like forward: reads the cache, does not write it."""
  model = nnx.merge(graph, state)
  positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  return model(tokens, positions=positions, cache=cache, write_cache=False).logits


def calibrate(target, *, batch_size: int, widths: Sequence[int] = DEFAULT_WIDTHS,
              repeats: int = 7, cache_length: int | None = None) -> CostTable:
  """Measures the target forward's time per width (ms, median of `repeats`).

  Each forward reads `width` new tokens per row against a cache of
  `min(512, context window)` slots, half full (or `cache_length` slots filled
  of a cache just large enough), and does not write it (as the verification
  branches do). Repeats go round-robin over the widths, so slow drift of the
  machine spreads over all of them.
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}.")
  widths = sorted({int(w) for w in widths} | {1})
  graph, state = nnx.split(target)
  capacity = _capacity(target)
  fill = capacity // 2
  if cache_length is not None:
    if not isinstance(cache_length, int) or cache_length < 0:
      raise ConfigError(f"cache_length must be an int >= 0, got {cache_length!r}.")
    fill = cache_length
    capacity = -(-(cache_length + max(widths)) // 64) * 64
  if fill + max(widths) > target.config.max_position_embeddings:
    fill = max(0, target.config.max_position_embeddings - max(widths))

  def forward(state, tokens, cache):
    return _forward(graph, state, tokens, cache)

  cache = target.init_cache(batch_size=batch_size, capacity=capacity)
  cache = cache.with_lengths(jnp.full((batch_size,), fill, jnp.int32))
  rng = np.random.default_rng(0)
  inputs = {w: jnp.asarray(rng.integers(0, target.config.vocab_size, (batch_size, w)), jnp.int32)
            for w in widths}
  costs = median_ms({w: functools.partial(forward, state, inputs[w], cache) for w in widths},
                     repeats=repeats)
  return CostTable(costs=costs, key=cache_key(target, batch_size=batch_size))


def compiled_forward(target, *, batch_size: int, width: int) -> jax.stages.Compiled:
  """The program `calibrate` times at `width` (default cache), compiled.

  Its optimized HLO (`.as_text()`) is what the device runs for a forward of
  `width` tokens a row, what a check of the compiler's work reads
  (`models.int8_hlo`). Compiled first here, `calibrate` of the same target
  and batch size then finds it compiled: JAX keeps the executable of a
  lowering it has compiled, and the inputs have `calibrate`'s shapes.
  """
  graph, state = nnx.split(target)
  cache = target.init_cache(batch_size=batch_size, capacity=_capacity(target))
  tokens = jnp.zeros((batch_size, width), jnp.int32)
  return _forward.lower(graph, state, tokens, cache).compile()


def for_target(target, *, batch_size: int, widths: Sequence[int] = (),
               directory: str | None = None, recalibrate: bool = False) -> CostTable:
  """The cached table of `target` at `batch_size`; calibrated (and saved) when missing.

  Args:
    target: the target model.
    batch_size: rows per forward.
    widths: widths the caller needs; any past the table's widest are measured
      and added to the cached file.
    directory: cache root (default `cache_dir()`); tables go to its costs/.
    recalibrate: measure again even if a table is cached.
  """
  key = cache_key(target, batch_size=batch_size)
  path = _path(key, directory)
  table = None if recalibrate else _stored(path)
  wanted = set(DEFAULT_WIDTHS) | {int(w) for w in widths}
  if table is None:
    table = calibrate(target, batch_size=batch_size, widths=sorted(wanted))
    table.save(path)
  elif max(wanted) > table.widths[-1]:
    extra = calibrate(target, batch_size=batch_size,
                      widths=[1] + [w for w in sorted(wanted) if w > table.widths[-1]])
    # Keep the cached measurements; rescale the new ones to the cached width 1.
    scale = table.costs[1] / extra.costs[1] if 1 in table.costs else 1.0
    merged = dict(table.costs)
    merged.update({w: c * scale for w, c in extra.costs.items() if w > table.widths[-1]})
    table = CostTable(costs=merged, key=key)
    table.save(path)
  _MEMO[path] = table
  return table


def modeled_draft_stage_fraction(drafter, target, *, block_size: int) -> float:
  """A drafting stage's cost in target decode steps, modeled: the weight bytes it reads over
  the target's.

  Decoding a token streams every weight of the target once; a drafting stage
  streams the drafter's own weights and the rows of its LM head (the target's,
  restricted to the draft vocabulary where it has one, read in bfloat16) once
  per drafter forward: one for a parallel drafter's whole block, gamma for an
  autoregressive one (`Drafter.forwards_per_stage`). Where the weights are not
  all a step costs (small models on a CPU, where a stage measured 0.19-0.24 of
  a step against a modeled 0.10-0.36), `draft_stage_fraction` takes the
  measured ratio once `measure_draft_stage` has cached it.
  """
  target_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target)))
  own = sum(x.nbytes for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
  spec = getattr(drafter, "spec", None)
  vocab = target.config.vocab_size
  if getattr(drafter, "reduced_vocab", False) and getattr(spec, "draft_vocab_size", 0):
    vocab = spec.draft_vocab_size
  head = vocab * target.config.hidden_size * 2
  forwards = drafter.forwards_per_stage(block_size, first=False)
  return forwards * (own + head) / max(target_bytes, 1)


STAGE_FORMAT = "dloop_jax.draft_stage/1"
STAGE_CONTEXT = 256  # committed tokens the drafter holds when a stage is timed


def _stage_key(target, drafter, *, batch_size: int, block_size: int) -> dict:
  params = sorted((str(k), tuple(x.shape), str(x.dtype)) for k, x in
                  jax.tree_util.tree_leaves_with_path(nnx.state(drafter, nnx.Param)))
  return dict(cache_key(target, batch_size=batch_size), drafter=str(drafter.name),
              drafter_params=hashlib.sha256(repr(params).encode()).hexdigest()[:16],
              block_size=int(block_size), what="draft_stage")


def measure_draft_stage(target, drafter, *, batch_size: int, block_size: int,
                        repeats: int = 15, directory: str | None = None) -> float:
  """Measures a drafting stage over a one-token target forward on this machine, caches it.

  A jitted `draft_stage` of `block_size` drafts after `STAGE_CONTEXT`
  committed tokens (random tokens and features), and the target's one-token
  forward as `calibrate` times it, interleaved; the ratio of their medians.
  """
  from dloop_jax.decoding import sampling as sampling_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  b, n = batch_size, STAGE_CONTEXT
  tgraph, tstate = nnx.split(target)
  cache = target.init_cache(batch_size=b, capacity=_capacity(target) + n)
  cache = cache.with_lengths(jnp.full((b,), _capacity(target) // 2, jnp.int32))
  token = jnp.asarray(rng.integers(0, target.config.vocab_size, (b, 1)), jnp.int32)
  dgraph, dparams = nnx.split(drafter)
  tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (b, n)), jnp.int32)
  features = jnp.asarray(0.1 * rng.standard_normal(
      (b, n, len(drafter.taps), target.config.hidden_size)), target.dtype)

  @jax.jit
  def committed(params):
    d = nnx.merge(dgraph, params)
    return d.commit(d.init_state(batch_size=b, capacity=n + 8 * block_size), tokens=tokens,
                    features=features, next_tokens=jnp.roll(tokens, -1, axis=1),
                    starts=jnp.zeros((b,), jnp.int32), counts=jnp.full((b,), n, jnp.int32))

  @jax.jit
  def stage(params, state):
    d = nnx.merge(dgraph, params)
    return d.draft_stage(state, key=jax.random.key(0), block_size=block_size,
                         sampling=sampling_lib.GREEDY)[1].tokens

  state = committed(dparams)
  ms = median_ms({"stage": functools.partial(stage, dparams, state),
                   "step": functools.partial(_forward, tgraph, tstate, token, cache)},
                  repeats=repeats)
  fraction = ms["stage"] / ms["step"]
  key = _stage_key(target, drafter, batch_size=batch_size, block_size=block_size)
  json_files.write_json(_path(key, directory),
                        {"format": STAGE_FORMAT, "fraction": fraction, "key": key}, default=str)
  return fraction


def cached_draft_stage(target, drafter, *, batch_size: int, block_size: int,
                       directory: str | None = None) -> float | None:
  """The fraction `measure_draft_stage` cached for these, or None."""
  path = _path(_stage_key(target, drafter, batch_size=batch_size, block_size=block_size),
               directory)
  try:
    with open(path) as f:
      data = json.load(f)
    value = float(data["fraction"]) if data.get("format") == STAGE_FORMAT else None
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return value if value is not None and math.isfinite(value) and value > 0 else None


def draft_stage_fraction(drafter, target, *, block_size: int, batch_size: int = 1,
                         measure: bool = False) -> float:
  """A drafting stage's cost in one-token target forwards, as gate="auto" weighs it: measured
  on this machine when cached (`measure_draft_stage`; measured now with `measure`), else
  modeled (`modeled_draft_stage_fraction`)."""
  cached_value = cached_draft_stage(target, drafter, batch_size=batch_size,
                                    block_size=block_size)
  if cached_value is None and measure:
    cached_value = measure_draft_stage(target, drafter, batch_size=batch_size,
                                       block_size=block_size)
  if cached_value is not None:
    return cached_value
  return modeled_draft_stage_fraction(drafter, target, block_size=block_size)


def as_table(value) -> CostTable:
  """A `CostTable` from a table, a {width: cost} mapping or a JSON file path."""
  if isinstance(value, CostTable):
    return value
  if isinstance(value, Mapping):
    return CostTable(costs=value)
  if isinstance(value, (str, os.PathLike)):
    return load(value)
  raise ConfigError("costs must be None, a CostTable, a {width: cost} mapping or the path of a"
                    f" JSON cost table, got {type(value).__name__}.")


# Default tables, in units of a one-token forward, for a target whose own table
# has not been measured on this machine (`python -m infer.costs` measures it).
# CPU: the shape measured for SmolLM2-135M on a 2-core x86 CPU (steep: every
# token of a forward multiplies every weight again), extended linearly.
# Accelerators: nearly flat, a forward reading every weight once whatever its
# width up to a few tens of tokens.
DEFAULT_TABLES = {
    "cpu": {1: 1.0, 2: 1.35, 3: 1.53, 5: 1.72, 9: 2.12, 13: 2.23, 17: 2.40, 25: 2.73,
            65: 4.40, 257: 12.4},
    "gpu": {1: 1.0, 17: 1.05, 65: 1.25, 257: 2.5},
    "tpu": {1: 1.0, 17: 1.05, 65: 1.25, 257: 2.5},
}
CALIBRATE = "calibrate"


class AssumedCostsWarning(UserWarning):
  """The scheduler decodes with a profile's default cost table: none was measured for this
  target on this machine (a command line reports it in one line of its own)."""


def cached(target, *, batch_size: int, widths: Sequence[int] = (),
           directory: str | None = None) -> CostTable | None:
  """The table `for_target` cached for `target` at `batch_size`, if it covers `widths`; no
  measuring."""
  path = _path(cache_key(target, batch_size=batch_size), directory)
  table = _stored(path)
  if table is None or (widths and max(widths) > table.widths[-1]):
    return None
  _MEMO[path] = table
  return table


def _stored(path: str) -> CostTable | None:
  """The table cached at `path` (in memory, else on disk); None when missing or damaged
  (a damaged entry is measured again by `for_target`)."""
  table = _MEMO.get(path)
  if table is None and os.path.exists(path):
    try:
      table = load(path)
    except ConfigError:
      return None
  return table


def default_table(profile) -> CostTable:
  """The profile's default table (`DEFAULT_TABLES`), for targets not yet measured here."""
  name = profiles.resolve(profile).name
  return CostTable(costs=DEFAULT_TABLES[name], key={"default": name})


def resolve(value, *, target, batch_size: int, widths: Sequence[int],
            profile=None) -> np.ndarray:
  """Costs [len(widths)] f32 at the compiled widths (`resolve_table`)."""
  return resolve_table(value, target=target, batch_size=batch_size, widths=widths,
                       profile=profile).at(widths)


def is_assumed(table: CostTable) -> bool:
  """Whether `table` is a profile's default (`DEFAULT_TABLES`), not a measurement here."""
  return "default" in (table.key or {})


def resolve_table(value, *, target, batch_size: int, widths: Sequence[int],
                  profile=None) -> CostTable:
  """The cost table of `generate()`'s `costs` argument.

  None: the file named by $DLOOP_COSTS, else the table cached for this target
  on this machine (`python -m infer.costs`, or `costs="calibrate"` once), else
  the profile's default table, with a warning saying how to measure the real
  one: generate() never times forwards unless asked to. "calibrate": the
  cached table, measured (and cached) first if missing.
  """
  if value is None:
    env = os.environ.get("DLOOP_COSTS")
    if env:
      table = load(env)
    else:
      table = cached(target, batch_size=batch_size, widths=widths)
      if table is None:
        table = default_table(profile)
        warnings.warn(
            f"No cost table measured for this target at batch size {batch_size} on this machine:"
            f" the scheduler uses the {table.key['default']} profile's default"
            " (decoding.costs.DEFAULT_TABLES). Measure it once with `python -m infer.costs`"
            " (or generate(costs='calibrate')).", AssumedCostsWarning, stacklevel=3)
  elif isinstance(value, str) and value == CALIBRATE:
    table = for_target(target, batch_size=batch_size, widths=widths)
  else:
    table = as_table(value)
  return table
