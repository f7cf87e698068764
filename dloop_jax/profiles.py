"""Backend profiles: the hardware-specific defaults, named and overridable.

What is fastest depends on the machine, not on the algorithm: how the target's
weight matrices are stored, the compute dtype, and the width every forward
runs at. Those choices live here, as named profiles resolved from
`jax.default_backend()` (or `$DLOOP_PROFILE`, or an explicit name), instead of
being baked into shared code:

    profile  compute   weights                  a 16-bit target's forwards
    cpu      float32   bf16 where it makes this 5 tokens wide (dloop: 2 stages of 2)
                       CPU's 5-token forward
                       cheaper, else f32
    gpu      bfloat16  bf16                     16 tokens wide (dloop: up to 3 stages)
    tpu      bfloat16  bf16                     16 tokens wide

f32 targets run each forward as wide as its tokens, the cost scheduler
choosing how many drafts to verify. The `cpu` profile writes forwards in
XLA:CPU's forms, the accelerator profiles in the standard one
(`models.cpu_kernels`).

Why (docs/decoding.md, "Profiles"): a fixed width pays where a forward of a
few tokens costs about what a one-token step costs. On accelerators that holds
for widths of tens of tokens. On CPUs it holds for bf16 weights where the
CPU multiplies bf16 at matrix speed. With Intel AMX a bf16 forward is cheaper
than an f32 one at every width. With AVX-512 BF16 and no AMX (AMD EPYC) a bf16
one-token step is slower than an f32 one, but a 5-token forward is cheaper
(the f32 forward's cost grows with its width, the bf16 one's hardly): there the
speculative rounds, which verify 5 tokens, pay for the slower plain steps. So
the `cpu` profile takes the storage whose forward at the fixed width this
machine measured cheaper (`python -m infer.costs --weights both` records it,
`record_cpu_weights`); until measured, the AMX flag decides. `--weights` /
`--profile` override the choice.

Every profile runs on every backend, so the accelerator code paths are tested
on CPU (`generate(profile="gpu")`, `python -m infer --profile gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform

from dloop_jax import json_files
from dloop_jax.errors import ConfigError

PROFILES = ("cpu", "gpu", "tpu")
# The fixed width of CPU profiles with 16-bit weights: two stages of gamma 2.
CPU_FIXED_WIDTH = 5
# On accelerators a forward of a few tens of tokens costs about a one-token
# step (both read every weight once): room for 3 stages of 4 or 2 of 7.
ACCELERATOR_FIXED_WIDTH = 16
DEFAULT_MAX_STAGES = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
  """Hardware-specific defaults of loading a target and decoding with it.

  Attributes:
    name: "cpu", "gpu" or "tpu".
    dtype: compute dtype of the target ("float32" / "bfloat16": activations,
      KV cache, norms); logits and acceptance stay f32.
    weights: storage of the weight matrices ("f32" / "bf16"; int8 is never a
      profile's choice, only asked for: `weights="int8"`, docs/decoding.md).
    fixed_width: the width of every forward after prefill of a 16-bit target
      (the only way its speculative outputs equal its `ar` output bit for bit,
      see `decoding.arguments.validate_exactness`), widened where the options
      ask for more drafts. f32 targets run at free widths.
    max_stages: S_max by default.
    cpu_kernels: whether forwards take XLA:CPU's forms (out-major 16-bit
      matrices, padded one-row products, barriers; `models.cpu_kernels`)
      instead of the standard one.
    attention_impl: the target's attention kernels
      (`models.attention_kernels`): "cudnn" on GPUs (cuDNN prefill, Pallas
      flash decoding), "pallas_tpu" on TPUs (Pallas paged attention), "xla"
      on CPUs.
    why: one line on the choice, printed by the command line.
  """

  name: str
  dtype: str
  weights: str
  fixed_width: int
  max_stages: int = DEFAULT_MAX_STAGES
  cpu_kernels: bool = False
  attention_impl: str = "xla"
  why: str = ""


def cpu_has_amx() -> bool:
  """Whether this CPU multiplies bf16 matrices natively (Intel AMX-BF16; Linux only)."""
  return "amx_bf16" in _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def _cpu_profile() -> Profile:
  measured = measured_cpu_weights()
  if measured is not None:
    weights = measured["weights"]
    wide = measured["width_cost"]
    why = (f"measured on this CPU (python -m infer.costs --weights both): a {CPU_FIXED_WIDTH}-token"
           f" forward costs {wide['bf16']:.3g} with bf16 weights, {wide['f32']:.3g} with f32: ")
  else:
    weights = "bf16" if cpu_has_amx() else "f32"
    why = ("not measured on this CPU (python -m infer.costs --weights both measures it):"
           f" {'AMX-BF16 present' if weights == 'bf16' else 'no AMX'}: ")
  if weights == "bf16":
    why += f"bf16 weight matrices, every forward {CPU_FIXED_WIDTH} tokens wide"
  else:
    why += "f32 weights, free widths chosen by the cost scheduler"
  return Profile(name="cpu", dtype="float32", weights=weights, fixed_width=CPU_FIXED_WIDTH,
                 cpu_kernels=True, why=why)


def cache_dir() -> str:
  """Where measurements of this machine are kept: $DLOOP_CACHE_DIR, else ~/.cache/dloop_jax."""
  return os.environ.get("DLOOP_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "dloop_jax")


CPU_WEIGHTS_FILE = "cpu_weights.json"


def _this_cpu() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  return dict(processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
              amx_bf16=cpu_has_amx(), jax=jax.__version__)


def record_cpu_weights(step_cost: dict[str, float], *, width_cost: dict[str, float],
                       directory: str | None = None) -> str:
  """Records which weight storage makes this CPU's speculative rounds cheaper; returns the file.

  The choice is the storage whose `CPU_FIXED_WIDTH`-token forward costs less:
  a 16-bit target runs every forward that wide (`Profile.fixed_width`), and an
  f32 one verifies up to that many tokens a round. The one-token costs are
  kept beside it, for the record.

  Args:
    step_cost: {"f32": cost, "bf16": cost} of a one-token target step (any
      unit, the same for both: `decoding.costs` tables at width 1).
    width_cost: the same at width `CPU_FIXED_WIDTH`.
  """
  for name, costs in (("step_cost", step_cost), ("width_cost", width_cost)):
    if set(costs) != {"f32", "bf16"} or not all(c > 0 for c in costs.values()):
      raise ConfigError(f"{name} needs positive 'f32' and 'bf16' costs, got {costs}.")
  weights = "bf16" if width_cost["bf16"] < width_cost["f32"] else "f32"
  path = os.path.join(directory or cache_dir(), CPU_WEIGHTS_FILE)
  return json_files.write_json(path, dict(
      machine=_this_cpu(), weights=weights, width=CPU_FIXED_WIDTH,
      step_cost={k: float(v) for k, v in step_cost.items()},
      width_cost={k: float(v) for k, v in width_cost.items()}))


def measured_cpu_weights(*, directory: str | None = None) -> dict | None:
  """The choice `record_cpu_weights` made on this machine (None: none, damaged, made on
  another CPU or JAX version, or by an older rule)."""
  path = os.path.join(directory or cache_dir(), CPU_WEIGHTS_FILE)
  try:
    with open(path) as f:
      record = json.load(f)
    if (record["machine"] != _this_cpu() or record["weights"] not in ("f32", "bf16")
        or record["width"] != CPU_FIXED_WIDTH):
      return None
    for costs in (record["step_cost"], record["width_cost"]):
      float(costs["f32"]), float(costs["bf16"])
    return record
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _accelerator_profile(name: str) -> Profile:
  return Profile(name=name, dtype="bfloat16", weights="bf16",
                 fixed_width=ACCELERATOR_FIXED_WIDTH,
                 attention_impl="cudnn" if name == "gpu" else "pallas_tpu",
                 why=f"{name.upper()}: bf16 weights, activations and KV cache; every forward"
                     f" {ACCELERATOR_FIXED_WIDTH} tokens wide")


def backend_profile_name() -> str:
  """The profile of the backend JAX runs on (`$DLOOP_PROFILE` overrides it)."""
  env = os.environ.get("DLOOP_PROFILE", "").strip()
  if env:
    return env
  import jax  # pylint: disable=g-import-not-at-top
  backend = jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    return "gpu"
  return "tpu" if backend == "tpu" else "cpu"


def resolve(profile: str | Profile | None = None) -> Profile:
  """A `Profile` from a name, a profile, or None (this backend's).

  Raises:
    ConfigError: an unknown profile name.
  """
  if isinstance(profile, Profile):
    return profile
  name = backend_profile_name() if profile is None else profile
  if name not in PROFILES:
    raise ConfigError(f"profile must be one of {PROFILES} (or None: this backend's), got"
                      f" {name!r}.")
  return _cpu_profile() if name == "cpu" else _accelerator_profile(name)


def precision(profile: str | Profile | None, *, dtype=None, weights=None) -> tuple:
  """(dtype, weights) of a target: those given; the profile fills what is not.

      given            result
      neither          the profile's dtype and weights
      dtype only       (dtype, None): weights stored in the compute dtype
      weights only     f32 weights: float32 compute; bf16 weights: the
                       profile's compute dtype (float32 on CPU, bf16 elsewhere)
  """
  if dtype is not None or weights is None:
    if dtype is None:
      p = resolve(profile)
      return p.dtype, p.weights
    return dtype, weights
  if _is_float32(weights):
    return "float32", weights
  return resolve(profile).dtype, weights


def _is_float32(value) -> bool:
  import numpy as np  # pylint: disable=g-import-not-at-top
  if isinstance(value, str):
    return value.lower() in ("f32", "float32", "fp32")
  return np.dtype(value) == np.float32
