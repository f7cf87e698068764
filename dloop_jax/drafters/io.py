"""Export and load trained drafters.

An export is a directory:

    drafter.json   format version, drafter kind / name / config, taps, block
                   size, the target it belongs to (name + fingerprint),
                   training metrics, the name, shape and dtype of every array,
                   and optionally "calibration": {name: table}, what its
                   stages yield by their score, per score and gamma
                   (`decoding.calibration`, measured by `python -m
                   train.calibrate`), which `load_drafter` attaches to the
                   drafter
    arrays/        Orbax checkpoint {"params": {name: array}, "model_state": {...}}
                   trainable weights (nnx.Param) stored in bfloat16, other
                   non-frozen variables (e.g. vocabulary maps) as they are;
                   or, with `weights="int8"`, matrices stored as int8 groups
                   with a float32 scale each ({"scales": {name: array}}), read
                   back as bfloat16 (`quantize_int8`)

Frozen weights shared with the target (its embedding, LM head) are not stored:
`load_drafter` takes them from the target it is given, after checking that the
drafter was trained for that target. `drafter.json` is written last, so a
directory holding it holds a complete export.

Names (not paths) resolve to drafters shipped in the package, under
`dloop_jax/drafters/weights/<name>/`.

Directories in the public Hugging Face layouts of EAGLE-3, DFlash, DSpark and Domino
drafters
(config.json + safetensors) load too, and `export_drafter(..., format="hf")`
writes them (`hf_format/`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dloop_jax import flat_state
from dloop_jax import json_files
from dloop_jax import plain_values
from dloop_jax.decoding import calibration as calibration_lib
from dloop_jax.drafters import hf_format
from dloop_jax.drafters import registry
from dloop_jax.drafters import variables as variables_lib
from dloop_jax.errors import ConfigError, DrafterMismatchError, ModelLoadError

FORMAT = "dloop_jax.drafter"
# Version 2: int8 weight storage (an older reader would take int8 values for weights).
VERSION = 2
INFO_FILE = "drafter.json"
ARRAYS_DIR = "arrays"
STORAGE_DTYPE = jnp.bfloat16
WEIGHTS_DIR = os.path.join(os.path.dirname(__file__), "weights")
FORMATS = ("dloop", "hf")
WEIGHT_STORAGES = ("bfloat16", "int8")
# Values of a weight matrix that share one int8 scale, along its last axis (as GGUF's Q8_0
# blocks of 32: a group's scale follows its local magnitude, so the rounding error stays a
# small fraction of bfloat16's own for these weights).
INT8_GROUP = 64


# orbax's marker of a finished write (written on file systems without atomic
# renames). Its text names the absolute directory written to; only its presence
# is read back.
_COMMIT_MARKER = "commit_success.txt"


def _make_commit_marker_portable(arrays_dir: str) -> None:
  """Rewrites the marker's text without the machine's path: exports are copied and shipped."""
  marker = os.path.join(arrays_dir, _COMMIT_MARKER)
  if os.path.exists(marker):
    with open(marker, "w") as f:
      f.write(f"Checkpoint commit was successful to {os.path.basename(arrays_dir)}")


def int8_group(shape: tuple[int, ...]) -> int:
  """Values per scale along the last axis (the whole axis when it is not a multiple)."""
  return INT8_GROUP if shape[-1] % INT8_GROUP == 0 else shape[-1]


def quantize_int8(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(q int8 [..., N], scale float32 [..., N / group]): symmetric, one scale a group.

  `dequantize_int8(q, scale)` returns value's bfloat16 rounding of q * scale.
  """
  v = np.asarray(value, dtype=np.float32)
  g = int8_group(v.shape)
  groups = v.reshape(*v.shape[:-1], v.shape[-1] // g, g)
  scale = np.abs(groups).max(axis=-1) / 127.0
  q = np.rint(groups / np.where(scale > 0, scale, 1.0)[..., None])
  return q.astype(np.int8).reshape(v.shape), scale.astype(np.float32)


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """The bfloat16 weights [..., N] of `quantize_int8`'s (q, scale)."""
  g = q.shape[-1] // scale.shape[-1]
  groups = q.astype(np.float32).reshape(*q.shape[:-1], scale.shape[-1], g)
  return (groups * scale[..., None]).reshape(q.shape).astype(STORAGE_DTYPE)


def _quantizes(value: Any) -> bool:
  """Whether int8 storage applies: float matrices (vectors such as norms stay bfloat16)."""
  return variables_lib.is_float(value) and np.ndim(value) >= 2


def export_drafter(drafter: nnx.Module, path: str | os.PathLike, *, target_name: str = "",
                   metrics: Mapping[str, Any] | None = None,
                   extra: Mapping[str, Any] | None = None,
                   format: str = "dloop",  # pylint: disable=redefined-builtin
                   weights: str = "bfloat16",
                   calibration: (Mapping[str, calibration_lib.Calibration]
                                 | Sequence[calibration_lib.Calibration] | None) = None
                   ) -> str:
  """Writes `drafter` (weights + config + its target's identity) to `path`.

  Every process must call it (the array write is collective); only process 0
  writes the JSON.

  Args:
    drafter: the drafter (weights may be sharded).
    path: export directory (replaced if it exists).
    target_name: name of the target it was trained for (informational; the
      fingerprint decides compatibility).
    metrics: final training metrics to record.
    extra: more JSON-serializable provenance (step, run config, ...).
    format: "dloop" (this module's layout) or "hf" (the public EAGLE-3 /
      DFlash layout: config.json + model.safetensors, for SGLang / vLLM;
      metrics and extra are not written there).
    weights: "bfloat16" or "int8" (matrices as int8 groups of `INT8_GROUP`
      values with a float32 scale each, about half the bytes; read back as
      bfloat16). "dloop" format only.
    calibration: tables stored with it (`decoding.calibration`: a mapping or
      sequence of them); "dloop" format only (the Hugging Face layouts have
      no place for them).

  Returns:
    The export directory.
  """
  if format not in FORMATS:
    raise ConfigError(f"Unknown drafter export format {format!r}; expected one of {FORMATS}.")
  if weights not in WEIGHT_STORAGES:
    raise ConfigError(f"Unknown drafter weight storage {weights!r}; expected one of"
                      f" {WEIGHT_STORAGES}.")
  if format == "hf":
    if weights != "bfloat16":
      raise ConfigError("The Hugging Face layouts store bfloat16 weights; int8 storage is"
                        " for our own format.")
    return hf_format.export_hf(drafter, path, target_name=target_name)
  path = os.path.abspath(os.fspath(path))
  _, params, _, _, model_state = variables_lib.split_drafter(drafter)
  flat_params = {k: jnp.asarray(v).astype(STORAGE_DTYPE) if variables_lib.is_float(v) else v
                 for k, v in flat_state.flat_values(params).items()}
  flat_scales = {}
  if weights == "int8":
    for k, v in flat_params.items():
      if _quantizes(v):
        flat_params[k], flat_scales[k] = quantize_int8(np.asarray(jax.device_get(v)))
  flat_model = flat_state.flat_values(model_state)
  info_path = os.path.join(path, INFO_FILE)
  if jax.process_index() == 0:
    os.makedirs(path, exist_ok=True)
    if os.path.exists(info_path):
      os.remove(info_path)  # the export is incomplete until the new JSON lands
  arrays = {"params": flat_params}
  if flat_model:
    arrays["model_state"] = flat_model
  if flat_scales:
    arrays["scales"] = flat_scales
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(path, ARRAYS_DIR), arrays, force=True)
    checkpointer.wait_until_finished()
  if jax.process_index() == 0:
    _make_commit_marker_portable(os.path.join(path, ARRAYS_DIR))

  def describe(tree):
    return {k: {"shape": list(np.shape(v)), "dtype": str(jnp.asarray(v).dtype)}
            for k, v in tree.items()}

  info = {
      "format": FORMAT,
      # Version 1 readers can read bfloat16 exports.
      "version": VERSION if flat_scales else 1,
      "weights": weights,
      "kind": getattr(drafter, "kind", None),
      "name": getattr(drafter, "name", type(drafter).__name__),
      "drafter_config": variables_lib.drafter_config_of(drafter),
      "taps": list(getattr(drafter, "taps", ())),
      "block_size": getattr(drafter, "block_size", None),
      "target": {"name": target_name,
                 "fingerprint": plain_values.to_plain(
                     dict(getattr(drafter, "target_fingerprint", ())))},
      "params": describe(flat_params),
      "model_state": describe(flat_model),
      **({"scales": describe(flat_scales), "int8_group": INT8_GROUP} if flat_scales else {}),
      "metrics": plain_values.to_plain(dict(metrics or {})),
      **({"extra": plain_values.to_plain(dict(extra))} if extra else {}),
      **({"calibration": _calibration_json(calibration)} if calibration else {}),
  }
  if jax.process_index() == 0:
    json_files.write_json(info_path, info, sort_keys=True)
  return path


def _calibration_json(tables) -> dict[str, Any]:
  return {name: table.to_json() for name, table in calibration_lib.named(tables).items()}


def write_calibration(name_or_path: str | os.PathLike,
                      tables: (Mapping[str, calibration_lib.Calibration]
                               | Sequence[calibration_lib.Calibration])) -> str:
  """Adds `tables` to the "calibration" of an export's `drafter.json`.

  A table of the same score and gamma is replaced, the others are kept (a
  malformed entry is replaced whole); the rest of the file is kept. The file
  is replaced atomically. Returns its path.
  """
  if is_hf_dir(name_or_path):
    raise ConfigError(f"{os.fspath(name_or_path)} is a Hugging Face drafter directory: it has"
                      f" no {INFO_FILE} to store a calibration in; export it first.")
  path = resolve(name_or_path)
  info = read_info(path)
  info_path = os.path.join(path, INFO_FILE)
  try:
    old = read_calibration(info, source=info_path)
  except ConfigError:
    old = {}
  info["calibration"] = _calibration_json(calibration_lib.merged(old, tables))
  json_files.write_json(info_path, info, sort_keys=True)
  return info_path


def read_calibration(info: Mapping[str, Any], *, source: str
                     ) -> dict[str, calibration_lib.Calibration]:
  """{name: table} of an export's `drafter.json` ({} when it has none)."""
  try:
    return calibration_lib.tables_from_json(info.get("calibration"))
  except ConfigError as e:
    raise ConfigError(f"{source}: malformed \"calibration\" entry: {e} Measure it again"
                      " (python -m train.calibrate --write) or remove the entry.") from None


def shipped_drafters() -> list[str]:
  """Names of drafters shipped in the package."""
  if not os.path.isdir(WEIGHTS_DIR):
    return []
  return sorted(n for n in os.listdir(WEIGHTS_DIR)
                if os.path.exists(os.path.join(WEIGHTS_DIR, n, INFO_FILE)))


def shipped_drafters_for(target_config: Any) -> list[str]:
  """Names of shipped drafters trained for this target, best first.

  "Best" is the order of `drafter.json`'s `rank` (lower first; set when a
  drafter is shipped, from the benchmark), then the name.
  """
  found = []
  for name in shipped_drafters():
    info = read_info(os.path.join(WEIGHTS_DIR, name))
    try:
      check_target(info, target_config, source=name)
    except DrafterMismatchError:
      continue
    found.append((int(info.get("rank", 1_000)), name))
  return [name for _, name in sorted(found)]


def resolve(name_or_path: str | os.PathLike) -> str:
  """An export directory from a path, a training workdir or a shipped name."""
  p = os.fspath(name_or_path)
  for candidate in (p, os.path.join(p, "export"), os.path.join(WEIGHTS_DIR, p)):
    if os.path.isfile(os.path.join(candidate, INFO_FILE)):
      return os.path.abspath(candidate)
  if os.path.isdir(p):
    raise ModelLoadError(
        f"{p} holds no drafter export ({INFO_FILE} missing) and no Hugging Face drafter"
        " (config.json missing). Point to an export directory (written by `python -m train`"
        " under <workdir>/export), a training workdir, or an EAGLE-3 / DFlash checkpoint.")
  names = shipped_drafters()
  raise ModelLoadError(
      f"No drafter {p!r}: not a directory, and not a shipped drafter"
      f" ({', '.join(names) if names else 'none are shipped'}).")


def is_hf_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a Hugging Face drafter directory (not one of our exports)."""
  p = os.fspath(path)
  return (os.path.isfile(os.path.join(p, hf_format.CONFIG_FILE))
          and not os.path.isfile(os.path.join(p, INFO_FILE)))


def read_info(path: str | os.PathLike) -> dict[str, Any]:
  """The `drafter.json` of an export (path already resolved)."""
  info_path = os.path.join(os.fspath(path), INFO_FILE)
  try:
    with open(info_path) as f:
      info = json.load(f)
  except (OSError, ValueError) as e:
    raise ModelLoadError(f"Cannot read {info_path}: {e}. The export is incomplete or"
                         " corrupt; export it again.") from e
  if info.get("format") != FORMAT:
    raise ModelLoadError(f"{info_path} is not a dloop_jax drafter export"
                         f" (format {info.get('format')!r}).")
  if int(info.get("version", 0)) > VERSION:
    raise ModelLoadError(f"{info_path} has format version {info['version']}; this library"
                         f" reads up to {VERSION}. Upgrade dloop_jax.")
  return info


def check_target(info: Mapping[str, Any], target_config: Any, *, source: str) -> None:
  """Raises DrafterMismatchError unless the export was trained for `target_config`."""
  mine = dict(info.get("target", {}).get("fingerprint", {}))
  theirs = target_config.fingerprint
  diffs = [f"{k}: drafter expects {mine[k]!r}, target has {theirs.get(k)!r}"
           for k in sorted(mine) if k in theirs and mine[k] != theirs[k]]
  bad_taps = [t for t in info.get("taps", ()) if not 0 <= t < target_config.num_layers]
  if bad_taps:
    diffs.append(f"tapped layers {bad_taps} do not exist in a"
                 f" {target_config.num_layers}-layer target")
  if diffs:
    trained_for = info.get("target", {}).get("name") or "another target"
    raise DrafterMismatchError(
        f"Drafter {source} was trained for {trained_for!r}, not for"
        f" {target_config.name or 'this target'!r}: " + "; ".join(diffs)
        + ". Use a drafter trained for this target.")


def read_arrays(path: str | os.PathLike, info: Mapping[str, Any]
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(params, model_state) of an export on the host: params in bfloat16 (int8 dequantized)."""
  def abstract(desc):
    return {k: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]))
            for k, d in desc.items()}

  target = {"params": abstract(info["params"])}
  if info.get("model_state"):
    target["model_state"] = abstract(info["model_state"])
  if info.get("scales"):
    target["scales"] = abstract(info["scales"])
  arrays_dir = os.path.join(os.fspath(path), ARRAYS_DIR)
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      out = checkpointer.restore(arrays_dir, target)
  except Exception as e:  # pylint: disable=broad-except
    raise ModelLoadError(f"Cannot read the drafter weights in {arrays_dir}"
                         f" ({type(e).__name__}: {str(e).splitlines()[0][:300]}). The export"
                         " is truncated or corrupt; export it again.") from e
  params = {k: np.asarray(v) for k, v in out["params"].items()}
  for k, scale in out.get("scales", {}).items():
    params[k] = dequantize_int8(params[k], np.asarray(scale))
  return params, {k: np.asarray(v) for k, v in out.get("model_state", {}).items()}


def load_drafter(name_or_path: str | os.PathLike, *, target: Any,
                 rngs: nnx.Rngs | None = None) -> nnx.Module:
  """Rebuilds an exported drafter for `target` and loads its weights.

  Args:
    name_or_path: export directory, training workdir (its `export/`), or the
      name of a shipped drafter.
    target: the target `Transformer` it drafts for (or the `LoadedTarget`
      holding it); frozen shared weights come from it and float weights are
      cast to its dtype.
    rngs: RNG streams for the drafter's construction (weights are overwritten).

  Raises:
    ModelLoadError: missing, incomplete or corrupt export.
    ConfigError: a malformed calibration table in its `drafter.json`.
    DrafterMismatchError: it was trained for another target.
    CheckpointFormatError: a Hugging Face layout our drafters cannot represent.
  """
  from dloop_jax.models.registry import LoadedTarget  # pylint: disable=g-import-not-at-top

  if isinstance(target, LoadedTarget):
    target = target.model

  if is_hf_dir(name_or_path):
    return hf_format.load_hf_drafter(name_or_path, target=target, rngs=rngs)
  path = resolve(name_or_path)
  info = read_info(path)
  check_target(info, target.config, source=path)
  tables = read_calibration(info, source=os.path.join(path, INFO_FILE))
  params_values, model_values = read_arrays(path, info)
  drafter = registry.build_for_loading(info["drafter_config"], target=target, rngs=rngs)
  _, params, _, _, model_state = variables_lib.split_drafter(drafter)
  dtype = getattr(target, "dtype", jnp.float32)
  nnx.update(drafter, variables_lib.assign(params, params_values, dtype=dtype, what="Weights",
                                           source=path))
  if model_values or flat_state.flat_values(model_state):
    nnx.update(drafter, variables_lib.assign(model_state, model_values, dtype=dtype,
                                             what="Variables", source=path))
  if hasattr(drafter, "check_target"):
    drafter.check_target(target.config)
  if tables:
    calibration_lib.attach(drafter, tables)
  return drafter
