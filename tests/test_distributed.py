"""When and how a training process joins a multi-process job (`distributed.plan`),
and its errors for inconsistent settings; no JAX involved. The two-process
training run itself is in test_trainer_sharding.py.
"""

from __future__ import annotations

import pytest

from dloop_jax.errors import ConfigError
from dloop_jax.training import distributed


@pytest.fixture(autouse=True)
def not_on_a_tpu_vm(monkeypatch):
  # The decisions below are about the environment variables given, not about
  # the machine the tests run on.
  monkeypatch.setattr(distributed, "on_cloud_tpu_vm", lambda: False)


def test_plan_single_process_by_default():
  assert distributed.plan("auto", environ={}) is None
  assert distributed.plan("off", environ={}) is None
  # One SLURM task or MPI rank is not a multi-process job.
  assert distributed.plan("auto", environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1",
                                           "OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_plan_explicit_flags_and_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3"}
  assert distributed.plan("auto", environ=env) == distributed.Launch(
      coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, cluster="explicit")
  # A flag wins over its variable.
  launch = distributed.plan("auto", process_id=0, environ=env)
  assert launch.process_id == 0 and launch.num_processes == 4


def test_plan_managed_clusters_fill_in_the_rest():
  slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}
  assert distributed.plan("auto", environ=slurm) == distributed.Launch(cluster="slurm")
  # A coordinator port of one's choosing, the rest from SLURM.
  launch = distributed.plan("auto", coordinator_address="node1:9999", environ=slurm)
  assert launch.kwargs() == {"coordinator_address": "node1:9999"}
  assert distributed.plan("auto", environ={"OMPI_COMM_WORLD_SIZE": "2"}).cluster == "openmpi"
  assert distributed.plan("auto", environ={"TPU_WORKER_HOSTNAMES": "a,b"}).cluster == "tpu"
  assert distributed.plan("on", environ={}) == distributed.Launch(cluster="auto")


@pytest.mark.parametrize("kwargs, env, match", [
    (dict(num_processes=2, process_id=0), {}, r"--coordinator_address \(JAX_COORDINATOR_ADDRESS\)"
     r" is not"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, "process ids are 0 .. 1"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), {}, "must be host:port"),
    (dict(num_processes=0), {}, "num_processes must be >= 1"),
    (dict(), {"JAX_PROCESS_ID": "one"}, "JAX_PROCESS_ID='one' is not an integer"),
    (dict(), {"JAX_PROCESS_ID": "1"}, "--process_id \\(JAX_PROCESS_ID\\) is set"),
])
def test_plan_inconsistent_settings(kwargs, env, match):
  with pytest.raises(ConfigError, match=match):
    distributed.plan("auto", environ=env, **kwargs)


def test_plan_off_with_settings_is_an_error():
  with pytest.raises(ConfigError, match="distributed='off' but --process_id"):
    distributed.plan("off", process_id=1, environ={})
  with pytest.raises(ConfigError, match="must be one of"):
    distributed.plan("yes", environ={})
