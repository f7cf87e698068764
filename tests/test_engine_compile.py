"""generate() is one compiled program: cached per static shape, gate and costs traced, loops nested."""

from __future__ import annotations

import math

import pytest

import drafter_fixtures
from dloop_jax.decoding import engine, generate, loop_copies
from dloop_jax.decoding import schedule as schedule_lib

# The shapes of test_engine_gate.py's runs: in one session they share its compile.
GAMMA, S_MAX, MAX_NEW = 2, 3, 25


@pytest.fixture(scope="module")
def drafter(tiny):
  return drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3)


def test_one_compile_per_shape(tiny, drafter):
  """Same shapes (other prompts, seed, gate, row limit, stop tokens) reuse the program."""
  kw = dict(mode="dloop", drafter=drafter, block_size=GAMMA, max_stages=S_MAX, draft_backoff=0,
            lookup="off")  # the gate alone decides the stages
  generate(tiny, [[5, 6, 7], [9, 1, 2, 3, 4]], max_new_tokens=MAX_NEW, gate=-0.5, **kw)
  traces = engine.trace_count()
  again = generate(tiny, [[1, 2], [3, 4, 5, 6, 7, 8, 9]], max_new_tokens=MAX_NEW, gate=-0.5,
                   seed=1, **kw)
  assert engine.trace_count() == traces and again.compile_seconds == 0.0
  # The gate is a traced value: -inf and +inf run the same program, and it is live.
  eager = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW, gate=-math.inf, **kw)
  lazy = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW, gate=math.inf, **kw)
  assert engine.trace_count() == traces
  assert eager.compile_seconds == lazy.compile_seconds == 0.0
  assert all(r.stage_histogram == [0, 0, 0, r.rounds] for r in eager.rows)
  assert all(r.stage_histogram == [0, r.rounds, 0, 0] for r in lazy.rows)
  # The cost table is traced too: flat, steep and file tables run the same program, and live
  # (with every width compiled: by default a flat table compiles fewer widths,
  # `schedule.choosable_widths`, tests/test_engine_schedule.py).
  flat = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW, gate=-math.inf,
                  costs={1: 1.0, 7: 1.0}, width_tolerance=0.0, **kw)
  steep = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW, gate=-math.inf,
                   costs={w: 10.0 ** w for w in range(1, 8)}, **kw)
  assert engine.trace_count() == traces
  assert flat.compile_seconds == steep.compile_seconds == 0.0
  assert flat.total.verified == flat.total.drafted and flat.total.plain_rounds == 0
  assert steep.total.verified == 0 and steep.total.plain_rounds == steep.total.rounds
  # And the drafting back-off: with nothing ever verified, rows pause drafting.
  paused = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW, gate=-math.inf,
                    costs={w: 10.0 ** w for w in range(1, 8)}, **dict(kw, draft_backoff=8))
  assert engine.trace_count() == traces and paused.compile_seconds == 0.0
  assert paused.tokens == steep.tokens
  assert all(0 < r.stage_histogram[0] < r.rounds for r in paused.rows)
  # max_new_tokens and the stop tokens are traced: another limit in the same cache
  # bucket, or other stop tokens, run the same program, and both are live.
  shorter = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW - 7, gate=-0.5, **kw)
  stop = shorter.tokens[0][3]
  stopped = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=MAX_NEW - 7, gate=-0.5,
                     stop_tokens=[stop], **kw)
  assert engine.trace_count() == traces
  assert shorter.compile_seconds == stopped.compile_seconds == 0.0
  assert all(len(t) == MAX_NEW - 7 for t in shorter.tokens)
  for full, cut in zip(shorter.tokens, stopped.tokens):
    assert cut == (full[:full.index(stop) + 1] if stop in full else full)
  # A limit whose cache needs a larger capacity bucket: a new program, compiled once.
  longer = generate(tiny, [[1, 2], [3, 4]], max_new_tokens=4 * MAX_NEW, gate=-0.5, **kw)
  assert engine.trace_count() == traces + 1 and longer.compile_seconds > 0
  assert all(len(t) == 4 * MAX_NEW for t in longer.tokens)
  again = generate(tiny, [[7], [8]], max_new_tokens=4 * MAX_NEW - 3, gate=0.0, **kw)
  assert engine.trace_count() == traces + 1 and again.compile_seconds == 0.0
  assert all(len(t) == 4 * MAX_NEW - 3 for t in again.tokens)


def test_clear_compiled_frees_the_programs(tiny):
  kw = dict(max_new_tokens=MAX_NEW + 5)
  generate(tiny, [[1, 2, 3]], **kw)
  assert generate(tiny, [[4, 5]], **kw).compile_seconds == 0.0
  engine.clear_compiled()
  traces = engine.trace_count()
  again = generate(tiny, [[4, 5]], **kw)
  assert again.compile_seconds > 0 and engine.trace_count() == traces + 1


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "eqns"):
        yield v
      elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        yield v.jaxpr


def _control_flow(jaxpr):
  """`while` / `cond` equations of `jaxpr`, looking inside jit calls but not inside loops."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("while", "cond"):
      found.append(eqn)
    elif eqn.primitive.name != "scan":
      for sub in _subjaxprs(eqn):
        found += _control_flow(sub)
  return found


def _whiles(jaxpr):
  return [e for e in _control_flow(jaxpr) if e.primitive.name == "while"]


def _body(while_eqn):
  return while_eqn.params["body_jaxpr"].jaxpr


def _switches(jaxpr, n):
  return [e for e in _control_flow(jaxpr)
          if e.primitive.name == "cond" and len(e.params["branches"]) == n]


def _branch_counts(jaxpr):
  """Sorted branch counts of the conds with several branches."""
  return sorted(len(e.params["branches"]) for e in _control_flow(jaxpr)
                if e.primitive.name == "cond" and len(e.params["branches"]) > 1)


def _iota_lengths(jaxpr):
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "iota" and len(eqn.params["shape"]) == 1:
      found.add(eqn.params["shape"][0])
    for sub in _subjaxprs(eqn):
      found |= _iota_lengths(sub)
  return found


def test_the_optimized_dloop_program_copies_no_cache_in_its_loops(tiny, drafter):
  """The round loop, the stage loop inside it and the switch over the verification widths
  write the KV cache in place: no copy of a cache-shaped array in any loop body of the program
  XLA optimized (test_one_compile_per_shape's program: not compiled again)."""
  kw = dict(mode="dloop", drafter=drafter, block_size=GAMMA, max_stages=S_MAX, draft_backoff=0,
            lookup="off")
  compiled, static = engine.decode_program(tiny, [[5, 6, 7], [9, 1, 2, 3, 4]],
                                           max_new_tokens=MAX_NEW, gate=-0.5, **kw)
  assert len(static.widths) > 1  # the verification is a switch
  text = compiled.as_text()
  assert "while(" in text and "conditional(" in text
  assert loop_copies.decode_cache_copies(tiny, [[5, 6, 7], [9, 1, 2, 3, 4]],
                                         max_new_tokens=MAX_NEW, gate=-0.5, **kw) == []


def test_loop_copies_finds_a_loop_that_copies_its_carry():
  """The counter on a loop that must copy (it returns its carry both updated and unchanged) and
  on one that updates in place."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x = jnp.zeros((4, 64, 8))
  shapes = [loop_copies.shape_text(x.shape, x.dtype)]
  assert shapes == ["f32[4,64,8]"]

  def swapping(x, n):
    return jax.lax.fori_loop(0, n, lambda i, c: (c[0].at[:, i].set(c[1][:, i] + 1.0), c[0]),
                             (x, x + 1.0))

  def in_place(x, n):
    return jax.lax.fori_loop(0, n, lambda i, a: a.at[:, i].set(a[:, i - 1] + 1.0), x)

  found = loop_copies.cache_copies_in_loops(jax.jit(swapping).lower(x, 5).compile().as_text(),
                                            shapes=shapes)
  assert found and all(c.shape == "f32[4,64,8]" for c in found)
  assert not loop_copies.cache_copies_in_loops(
      jax.jit(in_place).lower(x, 5).compile().as_text(), shapes=shapes)
  # Other shapes are not the cache's.
  assert not loop_copies.cache_copies_in_loops(
      jax.jit(swapping).lower(x, 5).compile().as_text(), shapes=["f32[4,64,9]"])


@pytest.mark.parametrize("schedule,widths", [
    ("off", (3, 5, 7)),  # one width per stage count, 1 + s * gamma
    ("cost", (1, 2, 3, 5, 7)),  # and the narrow widths the scheduler may pick
])
def test_dloop_program_nests_the_stage_loop_in_the_round_loop(tiny, drafter, schedule, widths):
  """dloop: round while_loop > (stage while_loop, a switch over the verify widths, then the
  while_loop of the drafting back-off's plain steps)."""
  assert schedule_lib.verify_widths(block_size=GAMMA, max_stages=S_MAX,
                                    schedule=schedule) == widths
  n = len(widths)
  jaxpr = engine.decode_jaxpr(tiny, [[1, 2, 3]], max_new_tokens=8, mode="dloop", drafter=drafter,
                              block_size=GAMMA, gate=-0.5, max_stages=S_MAX,
                              schedule=schedule).jaxpr
  (rounds,) = _whiles(jaxpr)
  assert not _switches(jaxpr, n)
  stages, pauses = _whiles(_body(rounds))
  assert len(_switches(_body(rounds), n)) == 1
  # A pause step is one plain target step: no drafting loop, no width switch.
  assert not _whiles(_body(pauses)) and not _switches(_body(pauses), n)
  # Verification is not inside the stage loop, and there is no third loop level.
  assert not _switches(_body(stages), n) and not _whiles(_body(stages))
  # Branch i verifies widths[i] tokens (their positions are an iota of that length; the
  # widest such iota: a branch also counts its widths[i] - 1 drafts).
  (switch,) = _switches(_body(rounds), n)
  for width, branch in zip(widths, switch.params["branches"]):
    assert max(_iota_lengths(branch.jaxpr) & set(widths)) == width

def test_ar_and_sd_programs_have_no_stage_loop(tiny, drafter):
  """ar: one loop, no verify switch; sd: the round loop holds a one-stage loop and one width
  (schedule="off"), or the widths 1, 2, 3 (= 1 + gamma) the scheduler picks from."""
  ar = engine.decode_jaxpr(tiny, [[1, 2, 3]], max_new_tokens=8).jaxpr
  (rounds,) = _whiles(ar)
  assert not _whiles(_body(rounds)) and not _control_flow(_body(rounds))
  sd = engine.decode_jaxpr(tiny, [[1, 2, 3]], max_new_tokens=8, mode="sd", drafter=drafter,
                           block_size=GAMMA, schedule="off").jaxpr
  (rounds,) = _whiles(sd)
  assert len(_whiles(_body(rounds))) == 2  # the one-stage loop and the back-off's steps
  # Two two-way conds: whether the drafter reads the deferred tokens before
  # drafting, and whether it reads the round's tokens now (`decoding.deferred`).
  assert _branch_counts(_body(rounds)) == [2, 2]
  sd = engine.decode_jaxpr(tiny, [[1, 2, 3]], max_new_tokens=8, mode="sd", drafter=drafter,
                           block_size=GAMMA).jaxpr
  (rounds,) = _whiles(sd)
  assert len(_whiles(_body(rounds))) == 2  # the one-stage loop and the back-off's steps
  assert _branch_counts(_body(rounds)) == [2, 2, 3]


def test_sd_is_planned_as_dloop_with_one_stage(tiny, drafter):
  """After resolution sd is DLoop with S_max = 1 (`decoding.plan`): one program for both, the
  same rounds and tokens, while each reports the mode it was asked for."""
  kw = dict(drafter=drafter, block_size=GAMMA, schedule="off", lookup="off")
  prompts = [[5, 6, 7], [9, 1, 2, 3, 4]]
  sd = generate(tiny, prompts, max_new_tokens=12, mode="sd", **kw)
  traces = engine.trace_count()
  one_stage = generate(tiny, prompts, max_new_tokens=12, mode="dloop", max_stages=1,
                       gate=-math.inf, **kw)
  assert engine.trace_count() == traces and one_stage.compile_seconds == 0.0
  assert one_stage.tokens == sd.tokens and one_stage.rows == sd.rows
  assert (sd.mode, sd.gate, one_stage.mode) == ("sd", None, "dloop")
  assert all(r.stage_histogram == [0, r.rounds] for r in sd.rows)


def test_the_persistent_compilation_cache_is_on_unless_opted_out(monkeypatch, tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  from dloop_jax import compilation_cache  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir  # the suite's own cache
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("DLOOP_JAX_CACHE", "off")
    assert compilation_cache.enable() is None and not jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("DLOOP_JAX_CACHE")
    monkeypatch.delenv("DLOOP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compilation_cache.enable() == str(tmp_path / ".cache/dloop_jax/jax_compilation")
    # Beside the machine's other measurements where they are kept elsewhere.
    monkeypatch.setenv("DLOOP_CACHE_DIR", str(tmp_path / "machine"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert compilation_cache.enable() == str(tmp_path / "machine" / "jax_compilation")
    # A directory the caller set stays; the command-line programs force theirs.
    monkeypatch.setenv("DLOOP_JAX_CACHE", str(tmp_path / "mine"))
    assert compilation_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir.startswith(str(tmp_path / "machine"))
    assert compilation_cache.enable(force=True) == str(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
