"""Sharded training on 8 simulated CPU devices matches 1 device, and two
processes with 4 CPU devices each (gloo collectives on localhost) train as one
process with 8 devices does, through a SIGKILL of both processes after a
checkpoint and a resume (online: the target inside the train step).

Runs in subprocesses: the device count is fixed when jax first initializes,
and the pytest process may already have done so with one device.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import trainer_hooks
import trainer_standin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    import jax, numpy as np
    assert jax.device_count() == 8, jax.devices()
    from dloop_jax.training import config as config_lib, sharding, trainer as trainer_lib
    import trainer_hooks

    def make_config(mesh):
      c = trainer_hooks.tiny_config()
      c.optim.warmup_steps = 0  # a non-zero learning rate at step 0
      c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
      c.sharding.min_shard_size = 256
      return c

    out = {}
    runs = {}
    for name, mesh, devices in (("one", (1, 1, 1), jax.devices()[:1]),
                                ("dp_fsdp", (2, 4, 1), None),
                                ("fsdp_tp", (2, 2, 2), None)):
      t = trainer_lib.Trainer(make_config(mesh), devices=devices)
      it, info = t.hooks.make_iterator(t.config, target=t.target, drafter=t.drafter,
                                       workdir=None, batch_size=t.local_batch_size,
                                       shard_index=0, shard_count=1)
      batch = next(it)
      initial = {k: np.asarray(v) for k, v in t.params.items()}
      metrics = jax.device_get(t.train_step(batch))
      runs[name] = dict(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]),
                        initial=initial,
                        params={k: np.asarray(v) for k, v in t.params.items()},
                        specs={k: [list(a) if isinstance(a, tuple) else a for a in v.sharding.spec]
                               for k, v in t.params.items()},
                        shard_shapes={k: [list(s.data.shape) for s in v.addressable_shards]
                                      for k, v in t.params.items()},
                        shapes={k: list(v.shape) for k, v in t.params.items()},
                        opt_specs=sorted({str(tuple(x.sharding.spec)) for x in
                                          jax.tree.leaves(t.opt_state) if hasattr(x, "sharding")}),
                        mesh=dict(t.mesh.shape))
    base = runs["one"]
    # Adam's first step moves a weight by lr * g / (|g| + eps): a full lr step
    # wherever |g| >> eps, and there the update hardly depends on g's last bits.
    lr = make_config((1, 1, 1)).optim.learning_rate
    steady = {k: np.abs(base["params"][k] - base["initial"][k]) >= 0.99 * lr
              for k in base["params"]}
    out["lr"] = lr
    for name, r in runs.items():
      out[name] = dict(
          loss=r["loss"], grad_norm=r["grad_norm"], specs=r["specs"], shard_shapes=r["shard_shapes"], shapes=r["shapes"],
          mesh=r["mesh"], opt_specs=r["opt_specs"],
          init_diff=max(float(np.max(np.abs(r["initial"][k] - base["initial"][k])))
                        for k in base["initial"]),
          param_diff=max(float(np.max(np.abs(r["params"][k] - base["params"][k])))
                         for k in base["params"]),
          steady_param_diff=max(float(np.max(np.abs(r["params"][k] - base["params"][k]),
                                             where=steady[k], initial=0.0))
                                for k in base["params"]),
          steady_fraction=sum(int(m.sum()) for m in steady.values())
                          / sum(m.size for m in steady.values()),
          update_size=min(float(np.max(np.abs(base["params"][k] - base["initial"][k])))
                          for k in base["params"]))
    # The multi-process test's reference: one process, 8 devices, the run
    # its two processes x 4 devices make from the command line.
    trainer_lib.train(trainer_hooks.tiny_config(**trainer_hooks.MULTIHOST_SETTINGS),
                      os.environ["REFERENCE_WORKDIR"])
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
  e = {k: v for k, v in os.environ.items()
       if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_",
                            "OMPI_", trainer_standin.KILL_AFTER_CHECKPOINT))}
  e["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
  e["JAX_PLATFORMS"] = "cpu"
  # The processes share their compiled programs (the eager ones of process 0,
  # the resumed run's train step).
  e["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
  e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return e


def _env(base: dict, devices: int, **extra: str) -> dict:
  # The test process's XLA flags, so that every run compiles alike.
  flags = os.environ.get("DLOOP_TEST_XLA_FLAGS", "")
  return dict(base, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
              **extra)


@pytest.fixture(scope="module")
def reference_workdir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("one_process"))


@pytest.fixture(scope="module")
def results(base_env, reference_workdir):
  env = _env(base_env, 8, REFERENCE_WORKDIR=reference_workdir)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def test_one_step_matches_single_device(results):
  base = results["one"]
  assert base["update_size"] > 1e-6  # the step did change every parameter
  for name in ("dp_fsdp", "fsdp_tp"):
    r = results[name]
    assert r["init_diff"] == 0.0, name
    assert abs(r["loss"] - base["loss"]) <= 1e-6 * abs(base["loss"]), name
    assert abs(r["grad_norm"] - base["grad_norm"]) <= 1e-5 * base["grad_norm"], name
    # Adam's first step moves every weight by lr * g / (|g| + eps). Where |g| >> eps
    # (nearly all weights) that is a full lr step, insensitive to the order of the
    # sharded reductions, and must agree closely. A weight whose gradient cancels
    # to a few eps amplifies last-bit differences of g by up to lr / eps (seen:
    # 2.4e-5 on one of 2,048 entries), but still moves by less than lr.
    assert r["steady_fraction"] >= 0.9, (name, r["steady_fraction"])
    assert r["steady_param_diff"] <= 1e-6, (name, r["steady_param_diff"])
    assert r["param_diff"] <= results["lr"], (name, r["param_diff"])


def test_params_are_sharded(results):
  r = results["dp_fsdp"]
  assert r["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  # The large matrices are split 4 ways over fsdp (heuristic or annotation),
  # small vectors stay replicated.
  for name in trainer_hooks.LARGE_PARAMS:
    assert "fsdp" in r["specs"][name], (name, r["specs"][name])
    full = r["shapes"][name]
    for shard in r["shard_shapes"][name]:
      assert shard != full and sum(a != b for a, b in zip(shard, full)) >= 1
      assert [f // s for f, s in zip(full, shard) if f != s] == [4]
  for name in trainer_hooks.SMALL_PARAMS:
    assert all(a is None for a in r["specs"][name]), (name, r["specs"][name])
  # Adam moments are sharded like their parameters.
  assert any("fsdp" in s for s in r["opt_specs"])


def test_tensor_axis_from_logical_annotation(results):
  r = results["fsdp_tp"]
  assert r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  for name, spec in trainer_hooks.ANNOTATED_SPECS.items():
    assert r["specs"][name] == spec, (name, r["specs"][name])


# ------------------------------------------------------------ two processes
NUM_STEPS = trainer_hooks.TINY_OVERRIDES["num_steps"]
EVERY = trainer_hooks.TINY_OVERRIDES["checkpoint.every_steps"]
KILL_AFTER = 8


def _command(workdir: str, *extra: str) -> list[str]:
  """The reference run's config (`tiny_config(**MULTIHOST_SETTINGS)`) from the command line."""
  return [sys.executable, "-m", "train", "--config", "configs/tiny.py:eagle3", "--workdir",
          workdir, *trainer_hooks.tiny_flags(**trainer_hooks.MULTIHOST_SETTINGS), *extra]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_all(commands: list[tuple[list[str], dict]], *, expect_kill: bool = False,
             timeout: float = 240) -> list[str]:
  """Runs the processes of one job together; returns their stderr.

  A process that fails takes the others down at once (they would wait for it
  in a collective until the coordinator's timeout).
  """
  procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True) for cmd, env in commands]
  deadline = time.monotonic() + timeout
  failed = None
  try:
    while any(p.poll() is None for p in procs):
      bad = [p for p in procs if p.poll() not in (None, 0)
             and not (expect_kill and p.returncode == -signal.SIGKILL)]
      if bad or time.monotonic() > deadline:
        failed = bad[0] if bad else None
        break
      time.sleep(0.05)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    errs = [p.communicate()[1] for p in procs]
  if failed is not None or any(p.returncode not in (0, -signal.SIGKILL) for p in procs):
    i = procs.index(failed) if failed is not None else 0
    pytest.fail(f"process {i} exited with {procs[i].returncode}:\n{errs[i][-4000:]}")
  want = -signal.SIGKILL if expect_kill else 0
  assert [p.returncode for p in procs] == [want] * len(procs), [e[-2000:] for e in errs]
  return errs


def _steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def _params(workdir: str, step: int) -> dict[str, np.ndarray]:
  """A checkpoint's params, read onto this process's one device (any topology)."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  path = os.path.join(workdir, "checkpoints", str(step), "params")
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as c:
    meta = c.metadata(path)
    tree = dict(getattr(meta, "item_metadata", meta))
    abstract = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
                for k, m in tree.items()}
    return {k: np.asarray(v) for k, v in c.restore(path, abstract).items()}


def _metrics(workdir: str) -> dict[int, dict]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  steps = [r["step"] for r in rows]
  assert steps == sorted(set(steps)), "a step was logged twice"
  return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_env, results, reference_workdir):
  del results  # it ran the one-process reference into reference_workdir
  two = str(tmp_path_factory.mktemp("two_processes"))
  port = _free_port()
  # Killed run: explicit flags. Both processes die once checkpoint 8 is on disk.
  killed = [(_command(two, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                      f"--process_id={i}"),
             _env(base_env, 4, **{trainer_standin.KILL_AFTER_CHECKPOINT: str(KILL_AFTER)}))
            for i in range(2)]
  _run_all(killed, expect_kill=True)
  killed_steps = _steps(two)
  killed_metrics = sorted(_metrics(two))
  # Resumed run: the same job described by the environment variables.
  port = _free_port()
  resumed = [(_command(two), _env(base_env, 4, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
             for i in range(2)]
  errs = _run_all(resumed)
  return dict(one=reference_workdir, two=two, killed_steps=killed_steps,
              killed_metrics=killed_metrics,
              resumed_stderr=errs)


def test_killed_after_checkpoint_and_resumed(runs):
  assert runs["killed_steps"] == [EVERY, KILL_AFTER]
  assert runs["killed_metrics"] == list(range(1, KILL_AFTER + 1))
  for i, err in enumerate(runs["resumed_stderr"]):
    assert "jax.distributed (explicit): process %d of 2" % i in err, err[-3000:]
    assert "Online training" in err, err[-3000:]
    resumed = re.search(r"Resumed from \S+ step (\d+)", err)
    assert resumed and int(resumed.group(1)) == KILL_AFTER, (i, err[-3000:])
  step_dir = os.path.join(runs["two"], "checkpoints", str(NUM_STEPS))
  # One data-iterator state per process, at the same place in the global order.
  states = [json.load(open(os.path.join(step_dir, "data_iter", f"process_{i}-of-2.json")))
            for i in range(2)]
  assert states[0] == states[1] == {"next_index": NUM_STEPS}
  # The weights are split over both processes' devices (fsdp 8): each process wrote its own
  # shards (Orbax's OCDBT keeps one store per process).
  params_dir = os.listdir(os.path.join(step_dir, "params"))
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(params_dir), params_dir
  assert os.path.exists(os.path.join(runs["two"], "export", "drafter.json"))


def test_two_processes_train_as_one_with_eight_devices(runs):
  one, two = runs["one"], runs["two"]
  m_one, m_two = _metrics(one), _metrics(two)
  assert sorted(m_one) == sorted(m_two) == list(range(1, NUM_STEPS + 1))
  # The same global batches and updates; the cross-process (gloo) reductions
  # sum in another order than the in-process ones: equal up to rounding.
  for step in m_one:
    for key in ("loss", "grad_norm", "acc_1"):
      np.testing.assert_allclose(m_two[step][key], m_one[step][key], rtol=2e-6,
                                 err_msg=f"{key} at step {step}")
  got, want = _params(two, NUM_STEPS), _params(one, NUM_STEPS)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
  moved = max(float(np.abs(want[k] - _params(one, EVERY)[k]).max()) for k in want)
  assert moved > 1e-3  # the parameters did change between the checkpoints compared
