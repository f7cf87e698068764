"""Reading a compiled program's optimized HLO text: computations, instructions, operands.

What XLA did to a program (the copies its passes added, which operations it
fused into one kernel) shows only after its passes, in the optimized module's
text (`jax.jit(f).lower(...).compile().as_text()`), not in the lowered one.
The checks that read it (`decoding.loop_copies`, `models.int8_hlo`) share
this small reader of the text format rather than XLA's protobufs, so they
need nothing beyond JAX and read any backend's program alike:

    %fused_computation (param_0: f32[2,256], param_1: s8[256,512]) -> f32[2,512] {
      %param_1 = s8[256,512]{1,0} parameter(1)
      %convert.3 = f32[256,512]{1,0} convert(%param_1), metadata={...}
      ROOT %dot.0 = f32[2,512]{1,0} dot(%param_0, %convert.3), lhs_contracting_dims={1}, ...
    }
    ENTRY %main.1 (x.1: f32[2,256], w.1: s8[256,512]) -> f32[2,512] {
      %ynn_fusion = f32[2,512]{1,0} fusion(%x.1, %w.1), kind=kCustom, calls=%fused_computation
    }

Names may be printed with or without their "%", operands with or without
their shapes ("f32[2,256]{1,0} %x.1"); both are read.
"""

from __future__ import annotations

import dataclasses
import re

# "%name (params) -> result {" or "ENTRY %name ... {": a computation's first line.
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)")
# "  [ROOT] %name = <result shape> <opcode>(" : an instruction.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(")
# Computations an instruction runs: body=, condition=, to_apply=, calls= and the
# branches of a conditional.
_CALLED = re.compile(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# An array in a result shape: "bf16[4096,6144]{1,0}" -> ("bf16", "4096,6144").
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_NO_OPERANDS = ("parameter", "constant", "iota")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction line, parsed.

  Attributes:
    name: its name, without "%".
    result: its result shape as printed ("f32[2,512]{1,0}", a tuple "(f32[2], s8[64])").
    opcode: "fusion", "dot", "custom-call", ...
    operands: the names of its operands, in order (empty for a parameter).
    line: the whole line, stripped.
    root: whether it is its computation's ROOT.
  """

  name: str
  result: str
  opcode: str
  operands: tuple[str, ...]
  line: str
  root: bool

  def arrays(self) -> list[tuple[str, int]]:
    """(element type, elements) of each array of the result ("s8", 4096 * 6144)."""
    return [(dtype, elements(dims)) for dtype, dims in _ARRAY.findall(self.result)]

  def called(self) -> list[tuple[str, str]]:
    """(how, computation) pairs this instruction runs (`called`)."""
    return called(self.line)

  def attribute(self, pattern: str) -> str | None:
    """The first group of `pattern` in the line's attributes (after the operands), or None."""
    m = re.search(pattern, self.line)
    return m.group(1) if m else None


def elements(dims: str) -> int:
  """Elements of an array of dimensions "4096,6144" ("" : a scalar, 1)."""
  n = 1
  for d in dims.split(","):
    if d:
      n *= int(d)
  return n


def computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines}."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    if current is None:
      m = COMPUTATION.match(line)
      if m and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
        current = m.group(1)
        out[current] = []
      continue
    if line.strip() == "}":
      current = None
    else:
      out[current].append(line)
  return out


def entry(hlo_text: str) -> str | None:
  """The name of the entry computation (None: the text has none)."""
  for line in hlo_text.splitlines():
    m = _ENTRY.match(line)
    if m:
      return m.group(1)
  return None


def called(line: str) -> list[tuple[str, str]]:
  """(how, computation) pairs an instruction line runs."""
  found = [(how, name) for how, name in _CALLED.findall(line)]
  for group in _BRANCHES.findall(line):
    found += [("branch", n.strip().lstrip("%")) for n in group.split(",") if n.strip()]
  return found


def parse(line: str) -> Instruction | None:
  """The instruction of a line (None: not an instruction)."""
  m = INSTRUCTION.match(line)
  if not m:
    return None
  opcode = m.group(3)
  operands = () if opcode in _NO_OPERANDS else _operands(line, m.end() - 1)
  return Instruction(name=m.group(1), result=m.group(2), opcode=opcode, operands=operands,
                     line=line.strip(), root=line.lstrip().startswith("ROOT "))


def _operands(line: str, start: int) -> tuple[str, ...]:
  """The operand names in the parentheses opening at `line[start]` ("(f32[2]{0} %a, %b)")."""
  depth, piece, pieces = 0, [], []
  for ch in line[start:]:
    if ch in "([{":
      depth += 1
      if depth == 1:
        continue
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        pieces.append("".join(piece))
        break
    if ch == "," and depth == 1:
      pieces.append("".join(piece))
      piece = []
    else:
      piece.append(ch)
  names = []
  for p in pieces:
    words = _COMMENT.sub(" ", p).split()  # "/*index=5*/%tokens.1": every fifth operand
    if words:
      names.append(words[-1].lstrip("%"))
  return tuple(names)


def instructions(comps: dict[str, list[str]]) -> dict[str, list[Instruction]]:
  """{computation name: its parsed instructions}, of `computations`' result."""
  return {name: [i for i in map(parse, lines) if i is not None] for name, lines in comps.items()}


def fused_computations(comps: dict[str, list[str]]) -> set[str]:
  """Names of the computations that are bodies of fusions (nested ones included): each
  runs inside the one kernel of its fusion instruction, writing no buffer of its own."""
  fused = set()
  for lines in comps.values():
    for line in lines:
      m = INSTRUCTION.match(line)
      if m and m.group(3) == "fusion":
        fused.update(callee for how, callee in called(line) if how == "calls")
  return fused


def unfused_from(comps: dict[str, list[str]], *starts: str) -> set[str]:
  """Names of `starts` and the computations they run through control flow and calls (loop
  bodies and conditions, branches, `call` / async computations, reducers), fusion bodies
  and custom calls' helpers left out: the computations whose instructions each run as
  operations of their own."""
  seen, todo = set(), list(starts)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      m = INSTRUCTION.match(line)
      if not m or m.group(3) == "fusion":
        continue
      todo += [callee for how, callee in called(line)
               if how != "calls" or m.group(3) in ("call", "async-start")]
  return seen
