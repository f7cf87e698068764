"""Copies of the KV cache inside the decode loop, read from a compiled program's HLO.

The decode is one program: a `while` over rounds holding the drafting loop and
a switch over the verification widths (`engine`). Each cache array is carried
by the loops and written in place; when XLA cannot prove a write may reuse the
carried buffer (a value read after it is overwritten, a branch of a switch
returning it unchanged while another updates it), its copy-insertion pass adds
a `copy` of the whole array, which then runs every iteration: at 8B shapes a
copy of one layer's cache moves as many bytes as the attention reads.

Copies only exist after XLA's passes, so this reads the optimized HLO text
(`jax.jit(f).lower(...).compile().as_text()`, `engine.decode_program`), not
the lowered module: counted are the `copy` / `copy-start` instructions of
every computation a `while` body runs (its own, those of the switches,
calls and loops inside it; not the fused computations, whose copies are
index arithmetic inside one kernel) whose result has a cache array's shape.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np

from dloop_jax import hlo_text as hlo

_COPIES = ("copy", "copy-start")


@dataclasses.dataclass(frozen=True)
class LoopCopy:
  """One copy of a cache-shaped array inside a loop body.

  Attributes:
    computation: the HLO computation holding it.
    name: the instruction's name.
    shape: its result ("f32[4,64,8]").
    op_name: the JAX operation it came from (HLO metadata), if recorded.
  """

  computation: str
  name: str
  shape: str
  op_name: str


def loop_computations(hlo_text: str) -> set[str]:
  """Names of the computations a `while` body runs, directly or through calls (not fusions)."""
  comps = hlo.computations(hlo_text)
  bodies = [callee for lines in comps.values() for line in lines
            if (m := hlo.INSTRUCTION.match(line)) and m.group(3) == "while"
            for how, callee in hlo.called(line) if how == "body"]
  return hlo.unfused_from(comps, *bodies)


def unfused_instructions(hlo_text: str) -> Iterator[str]:
  """The instruction lines of every computation that is not the body of a fusion (each
  operation of the program once: a fusion's own instruction stands for its body)."""
  comps = hlo.computations(hlo_text)
  fused = hlo.fused_computations(comps)
  for name, lines in comps.items():
    if name not in fused:
      yield from lines


def shape_text(shape: Sequence[int], dtype) -> str:
  """An array's shape as HLO writes it: "f32[4,64,8]" (bf16, s32, pred, ...)."""
  d = np.dtype(dtype)
  kind = {"f": "f", "i": "s", "u": "u", "b": "pred", "V": "bf"}[d.kind]
  name = "pred" if kind == "pred" else ("bf16" if d.name == "bfloat16"
                                          else f"{kind}{8 * d.itemsize}")
  return f"{name}[{','.join(str(int(n)) for n in shape)}]"


def cache_copies_in_loops(hlo_text: str, *, shapes: Iterable[str]) -> list[LoopCopy]:
  """The copies inside loop bodies whose result is one of `shapes` (`shape_text` strings).

  Args:
    hlo_text: an optimized program's HLO (`compiled.as_text()`).
    shapes: the cache arrays' shapes ("f32[4,64,8]"); layouts are ignored.

  Returns:
    One `LoopCopy` per copy instruction found (empty: the loops write the
    cache in place).
  """
  wanted = set(shapes)
  comps = hlo.computations(hlo_text)
  found = []
  for comp in sorted(loop_computations(hlo_text)):
    for line in comps.get(comp, []):
      m = hlo.INSTRUCTION.match(line)
      if not m or m.group(3) not in _COPIES:
        continue
      result = m.group(2)
      shapes_here = {s.split("{")[0] for s in re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", result)}
      hit = shapes_here & wanted
      if hit:
        op = re.search(r'op_name="([^"]*)"', line)
        found.append(LoopCopy(computation=comp, name=m.group(1), shape=sorted(hit)[0],
                              op_name=op.group(1) if op else ""))
  return found


def cache_shapes(*trees) -> list[str]:
  """`shape_text` of every array with 3 or more axes (caches' K / V arrays, a drafter's
  context cache) of the pytrees given."""
  return sorted({shape_text(x.shape, x.dtype) for tree in trees for x in jax.tree.leaves(tree)
                 if len(x.shape) >= 3})


def decode_cache_copies(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                        drafter=None, **options) -> list[LoopCopy]:
  """The in-loop cache copies of the program `generate()` runs for these arguments.

  The caches are the target's KV cache and the drafter's state at the
  program's batch and capacity (shapes only: nothing is allocated).
  """
  from dloop_jax.decoding import engine  # pylint: disable=g-import-not-at-top

  compiled, static = engine.decode_program(target, prompts, max_new_tokens=max_new_tokens,
                                           drafter=drafter, **options)
  b, cap = static.batch_size, static.capacity
  trees = [jax.eval_shape(lambda: target.init_cache(batch_size=b, capacity=cap))]
  if drafter is not None:
    trees.append(jax.eval_shape(lambda: drafter.init_state(batch_size=b, capacity=cap)))
  return cache_copies_in_loops(compiled.as_text(), shapes=cache_shapes(*trees))
