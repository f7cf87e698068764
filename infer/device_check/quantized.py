"""Int8 weights on this device: the accelerator profiles' weight-only products.

`weights="int8"` under the `gpu` / `tpu` profiles multiplies in the standard
form (`dloop_jax.models.int8`): int8 -> compute dtype on the product's operand,
a dot with f32 accumulation, x channel scale. It pays only where the compiler
fuses that conversion into the matrix product, which then reads the int8
bytes: a matrix converted first is read as int8, written and read again in
bf16, 5 bytes a weight where a bf16 matrix moves 2. XLA:CPU does not fuse it
by default (the `cpu` profile multiplies int8 in an integer form instead);
GPU and TPU compilers are expected to, and only a device can show it. At the
first batch size of the check, on a target of the check's shape with random
int8 weights, bf16 compute, in the standard form on every backend:

  hlo          the compiled forward of width 1 and of the fixed width W (the
               programs `decoding.costs.calibrate` times), read for how its
               int8 matrices are read (`models.int8_hlo`): products reading
               them as stored against arrays written whole; the texts are
               kept in DIR/int8_forward_w{width}.hlo.txt;
  speed        ms per forward at widths 1 and W against the bf16 target's
               (the speed section's isolated costs, same batch, same cache);
  correctness  greedy ar / sd / dloop at the fixed width, bit for bit
               ("fixed_int8", `checks`: one more configuration of fixed_bf16).

Its status ("int8" in the verdict): PASS where every int8 matrix is read
inside its product at both widths and none is written whole; on the CPU
anything else is a NOTE (converted first on cpu: expected, not what the
`cpu` profile runs); on a GPU or TPU it is a FAIL, because then the weight-only
form moves more bytes than bf16 weights would, against the reason the
accelerator profiles use it (docs/decoding.md, "Int8 weights"): a finding
the profile's product form must answer, not a number to read past.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from dloop_jax.decoding import costs as costs_lib
from dloop_jax.models import int8 as int8_lib
from dloop_jax.models import int8_hlo
from dloop_jax.models.transformer import LAYER_MATRICES


def expected_products(config) -> int:
  """Int8 products of one forward: every layer matrix, and the head (tied or not); the
  embedding's lookup is a row read, not a product."""
  return len(LAYER_MATRICES) * config.num_layers + 1


def smallest_matrix(target) -> int:
  """Elements of the target's smallest int8 matrix: smaller s8 arrays are not weights."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  sizes = [x.size for x in jax.tree.leaves(nnx.state(target))
           if int8_lib.is_int8(x.dtype) and x.ndim >= 2]
  return min(sizes)


def hlo_file(width: int) -> str:
  """The file name of the forward's optimized HLO at `width`."""
  return f"int8_forward_w{width}.hlo.txt"


def forward_reads(target, *, batch_size: int, widths, out_dir: str | None) -> dict:
  """Compiles the forward at each width and reads its HLO (`models.int8_hlo`).

  Returns:
    {str(width): `WeightReads.to_json()` with "compile_seconds" and "hlo" (the
    file written to `out_dir`; None: not written)}.
  """
  smallest = smallest_matrix(target)
  out = {}
  for width in widths:
    t0 = time.perf_counter()
    compiled = costs_lib.compiled_forward(target, batch_size=batch_size, width=width)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    entry = int8_hlo.weight_reads(text, min_elements=smallest).to_json()
    path = None
    if out_dir:
      os.makedirs(out_dir, exist_ok=True)
      path = hlo_file(width)
      with open(os.path.join(out_dir, path), "w") as f:
        f.write(text)
    out[str(width)] = dict(entry, compile_seconds=compile_s, hlo=path)
  return out


def judge(forwards: dict, *, expected: int, backend: str) -> tuple[str, str]:
  """(status, finding) of the forwards' reads: PASS, NOTE (the CPU) or FAIL (module
  docstring)."""
  short = [f"width {w}: {e['products']} of {expected} products read int8 as stored,"
           f" {len(e['whole'])} weight-sized array(s) written from an int8 matrix"
           for w, e in forwards.items() if e["whole"] or e["products"] != expected]
  if not short:
    return "PASS", (f"every int8 matrix read as stored inside its product ({expected} a forward)"
                    f" at widths {', '.join(forwards)}")
  finding = "; ".join(short)
  if backend == "cpu":
    return "NOTE", ("converted first on cpu, as expected there (XLA:CPU fuses the conversion"
                    " only under --xla_cpu_experimental_ynn_fusion_type; the cpu profile"
                    f" multiplies int8 in its integer form): {finding}")
  return "FAIL", f"int8 weights not read as stored by the weight-only products: {finding}"


def check(*, target, batch_size: int, width: int, repeats: int, bf16_costs: dict | None,
          out_dir: str | None, log=lambda _: None) -> dict:
  """The hlo and speed parts (module docstring) at one batch size.

  Args:
    target: the int8 target, standard form (`cpu_kernels=False`), bf16 compute.
    batch_size: rows of every forward.
    width: the fixed width W (the forwards are read and timed at 1 and W).
    repeats: timed calls per width (`costs.calibrate`).
    bf16_costs: the bf16 target's {str(width): ms} at this batch (the speed
      section's "cost_ms"), None where it was not measured.
    out_dir: where the HLO texts go (None: not written).
    log: progress lines.

  Returns:
    {"batch_size", "form", "expected_products", "forwards": `forward_reads`,
    "cost_ms", "bf16_cost_ms", "int8_over_bf16" ({str(width): ms or ratio}),
    "status", "finding"}.
  """
  widths = sorted({1, width})
  backend = jax.default_backend()
  expected = expected_products(target.config)
  forwards = forward_reads(target, batch_size=batch_size, widths=widths, out_dir=out_dir)
  for w, e in forwards.items():
    log(f"int8 forward, width {w}: {e['products']} of {expected} products read int8 as stored,"
        f" {len(e['whole'])} weight-sized writes, kernels {e['kernels'] or '–'}"
        f" (compile {e['compile_seconds']:.1f} s)")
  status, finding = judge(forwards, expected=expected, backend=backend)
  try:  # the programs just compiled: timing them compiles nothing more
    table = costs_lib.calibrate(target, batch_size=batch_size, widths=widths, repeats=repeats)
    costs = {str(w): table.costs[w] for w in widths}
  except Exception as e:  # pylint: disable=broad-except
    # An error of the timing keeps what the programs showed, and makes the part an ERROR.
    costs = {str(w): None for w in widths}
    status, finding = "ERROR", f"{finding}; timing the forwards: {type(e).__name__}: {e}"[:800]
  bf16 = {w: (bf16_costs or {}).get(w) for w in costs}
  ratio = {w: costs[w] / bf16[w] if costs[w] and bf16[w] else None for w in costs}
  return dict(batch_size=batch_size, form="weight-only (standard: int8 -> bf16, dot, x scale)",
              compute=jnp.dtype(target.dtype).name, expected_products=expected,
              forwards=forwards, cost_ms=costs, bf16_cost_ms=bf16, int8_over_bf16=ratio,
              status=status, finding=finding)
