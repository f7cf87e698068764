"""Multi-process (multi-host) start-up: when and how `jax.distributed.initialize` runs.

A pod run is the same program started once per host (or per GPU); the
processes find each other through a coordinator (process 0's address). Where
they come from, in order:

    explicit   --coordinator_address / --num_processes / --process_id, or the
               environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
               JAX_PROCESS_ID (a flag wins over its variable)
    slurm      srun with more than one task (SLURM_NTASKS > 1)
    openmpi    mpirun with more than one rank (OMPI_COMM_WORLD_SIZE > 1)
    tpu        a Cloud TPU VM (libtpu installed and a TPU device node present,
               or TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES set)

For slurm, openmpi and tpu JAX fills in what is not given explicitly
(`jax.distributed.initialize()` detects the cluster). `plan()` decides without
touching JAX, so the decision is testable; `initialize()` acts on it and must
run before anything touches a device.

Once the processes run, `check_same_config()` refuses a run whose processes
were started with different training configs.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from dloop_jax.errors import ConfigError

MODES = ("auto", "on", "off")
ENV_VARS = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
  """How `jax.distributed.initialize` is called (None: JAX detects it).

  Attributes:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: processes in the job.
    process_id: this process, in [0, num_processes).
    cluster: what described the job: "explicit", "slurm", "openmpi", "tpu" or
      "auto" (mode "on" with nothing detected: JAX's own detection decides).
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  cluster: str = "explicit"

  def kwargs(self) -> dict[str, object]:
    return {k: v for k, v in (("coordinator_address", self.coordinator_address),
                              ("num_processes", self.num_processes),
                              ("process_id", self.process_id)) if v is not None}


def _int_setting(name: str, flag: int | str | None, environ: Mapping[str, str]) -> int | None:
  source = f"--{name}"
  value = flag
  if value is None:
    value, source = environ.get(ENV_VARS[name]) or None, ENV_VARS[name]
  if value is None:
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ConfigError(f"{source}={value!r} is not an integer.") from None


def _count(environ: Mapping[str, str], name: str) -> int:
  try:
    return int(environ.get(name) or 1)
  except ValueError:
    return 1


def detect_cluster(environ: Mapping[str, str]) -> str | None:
  """The managed multi-process environment this process runs in, if any."""
  if "SLURM_JOB_ID" in environ and _count(environ, "SLURM_NTASKS") > 1:
    return "slurm"
  if _count(environ, "OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  if environ.get("TPU_WORKER_HOSTNAMES") or environ.get("TPU_PROCESS_ADDRESSES"):
    return "tpu"
  if on_cloud_tpu_vm():
    return "tpu"
  return None


def on_cloud_tpu_vm() -> bool:
  """libtpu installed and a TPU device node present (without starting JAX)."""
  return (importlib.util.find_spec("libtpu") is not None
          and bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")))


def plan(mode: str, *, coordinator_address: str | None = None,
         num_processes: int | str | None = None, process_id: int | str | None = None,
         environ: Mapping[str, str] | None = None) -> Launch | None:
  """Decides whether (and with what) to call `jax.distributed.initialize`.

  Args:
    mode: "auto" (initialize when explicit settings or a multi-process cluster
      are found), "on" (always; JAX detects what is not given) or "off" (never).
    coordinator_address / num_processes / process_id: explicit settings
      (command-line flags); None falls back to the JAX_* environment variables.
    environ: the environment (default os.environ).

  Returns:
    A Launch, or None for a single-process run.

  Raises:
    ConfigError: inconsistent settings (a process id outside the process
      count, a coordinator address without a port, explicit settings with
      mode "off", or explicit settings that leave the job underdetermined).
  """
  if mode not in MODES:
    raise ConfigError(f"distributed must be one of {MODES}, got {mode!r}.")
  environ = os.environ if environ is None else environ
  address = coordinator_address or environ.get(ENV_VARS["coordinator_address"]) or None
  count = _int_setting("num_processes", num_processes, environ)
  index = _int_setting("process_id", process_id, environ)
  given = {k: v for k, v in (("coordinator_address", address), ("num_processes", count),
                             ("process_id", index)) if v is not None}
  names = ", ".join(f"--{k} ({ENV_VARS[k]})" for k in given)
  if mode == "off":
    if given:
      raise ConfigError(f"distributed='off' but {names} set: drop them for a single-process"
                        " run, or use --config.distributed=auto.")
    return None
  if address is not None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
      raise ConfigError(f"--coordinator_address={address!r} must be host:port (process 0's"
                        " address and a free port, e.g. 10.0.0.1:1234).")
  if count is not None and count < 1:
    raise ConfigError(f"--num_processes must be >= 1, got {count}.")
  if index is not None and index < 0:
    raise ConfigError(f"--process_id must be >= 0, got {index}.")
  if count is not None and index is not None and index >= count:
    raise ConfigError(f"--process_id={index} is not below --num_processes={count}: process ids"
                      f" are 0 .. {count - 1}.")
  cluster = detect_cluster(environ)
  if given and cluster is None:
    missing = [f"--{k} ({ENV_VARS[k]})" for k in ENV_VARS if k not in given]
    if missing:
      raise ConfigError(f"A multi-process run outside SLURM, Open MPI or a Cloud TPU needs all of"
                        f" --coordinator_address, --num_processes and --process_id; {names}"
                        f" {'is' if len(given) == 1 else 'are'} set, {', '.join(missing)}"
                        f" {'is' if len(missing) == 1 else 'are'} not.")
    return Launch(coordinator_address=address, num_processes=count, process_id=index,
                  cluster="explicit")
  if given or cluster is not None or mode == "on":
    return Launch(coordinator_address=address, num_processes=count, process_id=index,
                  cluster=cluster or "auto")
  return None


def initialize(mode: str = "auto", *, coordinator_address: str | None = None,
               num_processes: int | str | None = None, process_id: int | str | None = None,
               initialization_timeout_s: int = 300) -> Launch | None:
  """`plan()`, then `jax.distributed.initialize` if it says so.

  Must run before any JAX computation (JAX fixes the device list at its first).
  Returns the Launch used (None: single process).
  """
  launch = plan(mode, coordinator_address=coordinator_address, num_processes=num_processes,
                process_id=process_id)
  if launch is None:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top

  try:
    jax.distributed.initialize(**launch.kwargs(),
                               initialization_timeout=int(initialization_timeout_s))
  except (RuntimeError, ValueError) as e:
    raise ConfigError(
        f"jax.distributed.initialize ({launch.cluster}: {launch.kwargs() or 'detected'})"
        f" failed: {str(e).strip().splitlines()[0][:300]}. Every process must be started with"
        " the same coordinator address and process count, distinct process ids, and before"
        " anything else uses JAX.") from e
  if launch.num_processes is not None and jax.process_count() != launch.num_processes:
    raise ConfigError(f"jax.distributed joined {jax.process_count()} processes, not the"
                      f" {launch.num_processes} of --num_processes.")
  logging.info("jax.distributed (%s): process %d of %d, %d local / %d global devices",
               launch.cluster, jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())
  return launch


def check_same_config(config: Mapping[str, Any]) -> None:
  """Raises ConfigError unless every process of the run has this config.

  Processes started with different settings would deadlock at the first
  collective whose shapes differ, or silently train on mismatched steps.
  """
  import hashlib  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  from dloop_jax import plain_values  # pylint: disable=g-import-not-at-top

  text = json.dumps(plain_values.to_plain(config), sort_keys=True, default=str)
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
  differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
  if differ:
    raise ConfigError(f"Processes {differ} were started with another training config than process"
                      " 0: start every process with the same --config file and --config.*"
                      " overrides (only --process_id differs).")
