"""Whether a compiled program reads its int8 weight matrices as they are stored.

An int8 matrix pays off only if the product reads its int8 bytes: a program
that first writes the matrix converted to the compute dtype (or copies it
whole) moves more bytes than a 16-bit matrix would (`models.int8`). Where
that happens is decided by the compiler's fusion passes, so it shows only in
the optimized HLO text (`jax.jit(f).lower(...).compile().as_text()`,
`dloop_jax.hlo_text`), and differs by backend:

    backend   a product that reads the int8 weight as stored
    XLA:CPU   a `fusion` with `"kind":"__ynn_fusion"` (YNNPACK) whose body
              takes the s8 parameter into its `dot` (the integer product; the
              weight-only "convert -> dot" under
              `--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise`)
    GPU       a `fusion` `kind=kCustom` with `"kind":"__triton_gemm"` (the
              legacy Triton GEMM emitter: convert and dot in one body) or
              whose operands pass through nested fusions
              (`"__triton_nested_gemm_fusion"`, the generic Triton emitter) into
              the `dot`; a `"__cudnn$fusion"`; a dot rewritten as multiply +
              `reduce` for one row (a kLoop / kInput fusion)
    TPU       a `fusion` (kOutput, ...) whose body takes the s8 parameter
              through its convert into a `convolution` or `dot`

and, on every backend, a GEMM library call (`custom-call` whose target names
a gemm or matmul: `__cublas$gemm`, `__cublas$lt$matmul`) taking the s8 array
itself. What is NOT read as stored: a fusion that only converts (or copies,
transposes) the weight and returns that array, whole, to a separate product
(XLA:CPU's default for two or more rows; on a GPU, what a cuBLAS GEMM the
autotuner picked over Triton needs: a kLoop convert fusion writing bf16[K, N]
before the `__cublas$gemm` custom call).

The reading: a weight is an s8 array of at least `min_elements` that a
non-fused computation the entry runs (itself, a loop body, a called or async
computation) receives as a parameter (or a view of one: `bitcast`,
`get-tuple-element`). Each use of one is followed: through control flow
(`while`, `call`, `conditional`, `tuple`: the weight is a parameter again in
the callee), into a fusion's body from the matching `parameter(i)` through
element-wise and layout operations and nested fusions, until it reaches a
product (`dot`, `convolution`, `reduce`, a gemm custom call), a row read
(`gather`, `dynamic-slice`, `slice`: an embedding lookup, neither a product
nor a copy, whatever follows it), or the fusion's result (the weight,
converted or not, leaves the kernel: written whole when that result is as
large as the weight). The assumptions: the text is XLA's format, with
`calls=` naming fused bodies and operands in parentheses after the opcode;
each weight matrix is an array of its own (a slice of a stacked one would
count as a row read); a product kernel whose body holds the conversion reads
the stored bytes (what Triton, cuDNN, YNNPACK and TPU fusions do with their
operands).
"""

from __future__ import annotations

import dataclasses
import re

from dloop_jax import hlo_text as hlo

WEIGHT_TYPE = "s8"
# Operations that multiply what reaches them: a matrix product, a convolution (TPUs
# write dots as such), a reduce (XLA's one-row products, rewritten as multiply + reduce).
PRODUCTS = ("dot", "convolution", "reduce")
# Library products, by their custom-call target (cuBLAS, cuBLASLt, cuDNN GEMMs).
_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
# Operations that read rows of a table: an embedding lookup (one row: a dynamic slice), not
# a product; what follows them (a norm's reduce) is not one either.
ROW_READS = ("gather", "dynamic-slice", "slice")
# Operations that hand an array to another computation (where it is a parameter again),
# or return a view of it, without writing it.
_PASSES = ("tuple", "while", "call", "conditional", "async-start", "optimization-barrier",
           "domain")
_VIEWS = ("bitcast", "get-tuple-element")


@dataclasses.dataclass(frozen=True)
class WeightReads:
  """How a program's int8 weights are read.

  Attributes:
    weights: s8 parameters of the entry computation with at least
      `min_elements` (the weight matrices the program is given).
    products: uses of a weight by a product that reads it as stored (inside
      the product's fusion, or a GEMM library call taking the s8 array); a
      matrix used by two products counts twice.
    rows: uses that gather rows of a weight (an int8 embedding table).
    whole: the instructions that write an array as large as a weight from one
      (a conversion, a copy, a transpose), shortened: what a program reading
      every weight as stored has none of.
    other: uses of neither kind, shortened (a form this reader does not know).
    kernels: {product kind: uses}: the fusion's backend kind
      ("__triton_gemm", "__ynn_fusion"), else its `kind=` ("kOutput"), a
      custom call's target ("__cublas$gemm"), or the opcode ("dot").
  """

  weights: int
  products: int
  rows: int
  whole: tuple[str, ...]
  other: tuple[str, ...]
  kernels: dict[str, int]

  def to_json(self) -> dict:
    return dict(weights=self.weights, products=self.products, rows=self.rows,
                whole=list(self.whole), other=list(self.other), kernels=dict(self.kernels))


def weight_reads(hlo_text: str, *, min_elements: int) -> WeightReads:
  """Reads an optimized program's HLO for how its int8 weights are read (module docstring).

  Args:
    hlo_text: `compiled.as_text()` of any backend.
    min_elements: the smallest weight matrix's elements: smaller s8 arrays
      (activation codes of the integer product) are not weights.

  Returns:
    The counts and the offending instructions (`WeightReads`).
  """
  lines = hlo.computations(hlo_text)
  comps = hlo.instructions(lines)
  entry = hlo.entry(hlo_text)
  unfused = (hlo.unfused_from(lines, entry) if entry is not None
             else set(comps) - hlo.fused_computations(lines))
  given = products = rows = 0
  whole, other, kernels = [], [], {}
  for comp, items in comps.items():
    if comp not in unfused:
      continue
    weights = _weights(items, min_elements=min_elements)
    if comp == entry:
      # A parameter, or an element of a tuple parameter; not a bitcast view of one.
      given = sum(1 for i in items if i.name in weights and i.opcode != "bitcast")
    for inst in items:
      used = [name for name in dict.fromkeys(inst.operands) if name in weights]
      if not used or inst.name in weights or inst.opcode in _PASSES:
        continue
      for name in used:
        reached = _reached(inst, name, comps)
        if "product" in reached:
          products += 1
          kind = _kind(inst)
          kernels[kind] = kernels.get(kind, 0) + 1
        elif "rows" in reached:
          rows += 1
        large = any(n >= weights[name] for _, n in inst.arrays())
        if large and ("result" in reached or not reached):
          whole.append(_short(inst))
        elif not reached.intersection(("product", "rows")):
          other.append(_short(inst))
  return WeightReads(weights=given, products=products, rows=rows, whole=tuple(whole),
                     other=tuple(other), kernels=kernels)


def _weights(items: list[hlo.Instruction], *, min_elements: int) -> dict[str, int]:
  """{name: elements} of the weights of one non-fused computation: s8 parameters of at least
  `min_elements`, a tuple parameter's s8 elements, and views of these."""
  weights, tuples = {}, {i.name for i in items if i.opcode == "parameter"}
  changed = True
  while changed:
    changed = False
    for inst in items:
      if inst.name in weights:
        continue
      arrays = inst.arrays()
      if len(arrays) != 1 or arrays[0][0] != WEIGHT_TYPE or arrays[0][1] < min_elements:
        if inst.opcode == "get-tuple-element" and inst.operands[0] in tuples:
          if inst.name not in tuples:  # a tuple of a tuple parameter
            tuples.add(inst.name)
            changed = True
        continue
      source = inst.operands[0] if inst.operands else None
      if (inst.opcode == "parameter" or inst.opcode == "get-tuple-element" and source in tuples
          or inst.opcode in _VIEWS and source in weights):
        weights[inst.name] = arrays[0][1]
        changed = True
  return weights


def _reached(inst: hlo.Instruction, name: str, comps: dict[str, list[hlo.Instruction]]) -> set:
  """Where weight `name`, an operand of `inst`, goes: {"product", "rows", "result"}
  ("result": it leaves `inst` as (part of) its result)."""
  if inst.opcode in PRODUCTS or inst.opcode == "custom-call" and _is_gemm(inst):
    return {"product"}
  if inst.opcode in ROW_READS:
    return {"rows"}
  if inst.opcode != "fusion":
    return {"result"}
  body = next((callee for how, callee in inst.called() if how == "calls"), None)
  indices = [i for i, operand in enumerate(inst.operands) if operand == name]
  return _trace(body, indices, comps)


def _trace(body: str | None, indices: list[int], comps: dict[str, list[hlo.Instruction]]) -> set:
  """Where parameters `indices` of fused computation `body` go (`_reached`'s words)."""
  items = comps.get(body or "", [])
  todo = [i.name for i in items if i.opcode == "parameter"
          and int(i.attribute(r"parameter\((\d+)\)") or -1) in indices]
  reached, seen = set(), set(todo)
  while todo:
    name = todo.pop()
    for inst in items:
      if name not in inst.operands:
        continue
      step = _reached(inst, name, comps)  # a nested fusion: into its body and out again
      reached |= step - {"result"}
      if "result" in step and inst.name not in seen:
        seen.add(inst.name)
        todo.append(inst.name)
    if any(i.root and i.name == name for i in items):
      reached.add("result")
  return reached


def _is_gemm(inst: hlo.Instruction) -> bool:
  target = inst.attribute(r'custom_call_target="([^"]*)"')
  return bool(target and _GEMM_TARGET.search(target))


def _kind(inst: hlo.Instruction) -> str:
  """The kernel kind of a product instruction (`WeightReads.kernels`)."""
  if inst.opcode == "custom-call":
    return inst.attribute(r'custom_call_target="([^"]*)"') or "custom-call"
  if inst.opcode == "fusion":
    return (inst.attribute(r'"kind":"([^"]+)"') or inst.attribute(r"\bkind=(\w+)")
            or "fusion")
  return inst.opcode


def _short(inst: hlo.Instruction) -> str:
  """`inst` without its metadata and backend configuration: name, result, operands, kind."""
  text = f"{inst.name} = {inst.result} {inst.opcode}({', '.join(inst.operands)})"
  kind = _kind(inst) if inst.opcode in ("fusion", "custom-call") else None
  return text + (f" [{kind}]" if kind else "")
