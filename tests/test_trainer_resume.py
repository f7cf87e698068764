"""SIGKILL the trainer mid-save (offline) and after a checkpoint (online), rerun the
same command: it resumes from the newest complete checkpoint and ends with the
uninterrupted run's parameters, bit for bit. (Killed mid-save, the run has complete
checkpoints and one in flight: the resume after a plain checkpoint is its special
case, checked online below; two processes: tests/test_trainer_sharding.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import trainer_hooks

ROOT = trainer_hooks.ROOT
NUM_STEPS = 40
TMP_MARK = ".orbax-checkpoint-tmp"


def _command(workdir: str, every: int, *extra: str) -> list[str]:
  return [sys.executable, "-m", "train", "--config", "configs/tiny.py:eagle3", *extra,
          "--workdir", workdir,
          f"--config.hooks={trainer_hooks.STANDIN}",
          f"--config.num_steps={NUM_STEPS}",
          f"--config.checkpoint.every_steps={every}",
          "--config.checkpoint.keep=3",
          "--config.data.num_examples=64",
          "--config.data.seq_len=32",
          "--config.log_every_steps=1",
          "--config.progress_bar=False",
          "--config.tensorboard=False"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  e = dict(os.environ)
  e["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
  e["JAX_PLATFORMS"] = "cpu"
  # Every run compiles the same step: share the executables.
  e["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
  e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return e


def _run(workdir: str, every: int, env: dict, *extra: str) -> subprocess.CompletedProcess:
  proc = subprocess.run(_command(workdir, every, *extra), env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def _steps(ckpt_dir: str) -> list[int]:
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def _tmp_dirs(ckpt_dir: str) -> list[str]:
  if not os.path.isdir(ckpt_dir):
    return []
  return [n for n in os.listdir(ckpt_dir) if TMP_MARK in n]


def _kill_when(workdir: str, every: int, env: dict, ready, *extra: str
               ) -> tuple[list[int], list[str]]:
  """Starts a run, SIGKILLs it once `ready(ckpt_dir)`; returns what was on disk then."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  proc = subprocess.Popen(_command(workdir, every, *extra), env=env, cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  try:
    while time.monotonic() < deadline:
      if proc.poll() is not None:
        pytest.fail("the run finished before it could be killed:\n"
                    + proc.stderr.read()[-3000:])
      if ready(ckpt_dir):
        proc.send_signal(signal.SIGKILL)
        break
      time.sleep(0.002)
    else:
      pytest.fail("timed out waiting for a checkpoint")
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  return _steps(ckpt_dir), _tmp_dirs(ckpt_dir)


def _final_params(workdir: str) -> dict[str, np.ndarray]:
  path = os.path.join(workdir, "checkpoints", str(NUM_STEPS), "params")
  with ocp.StandardCheckpointer() as c:
    return {k: np.asarray(v) for k, v in c.restore(path).items()}


def _losses(workdir: str) -> dict[int, float]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  steps = [r["step"] for r in rows]
  assert steps == sorted(set(steps)), "a step was logged twice"
  return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
  workdir = str(tmp_path_factory.mktemp("reference"))
  _run(workdir, 4, env)
  return workdir


def _assert_same_run(workdir: str, reference: str) -> None:
  got, want = _final_params(workdir), _final_params(reference)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert _losses(workdir) == _losses(reference)
  assert sorted(_losses(reference)) == list(range(1, NUM_STEPS + 1))


def test_kill_during_save_resumes_from_last_complete(tmp_path, env, reference):
  workdir = str(tmp_path / "killed_mid_save")
  # A save every step: one is almost always in flight.
  steps, tmp = _kill_when(workdir, 1, env, lambda d: bool(_steps(d)) and bool(_tmp_dirs(d)))
  assert tmp, "no save was in flight at the kill"
  in_flight = int(tmp[0].split(".")[0])
  assert in_flight not in steps
  proc = _run(workdir, 1, env)
  resumed = re.search(r"Resumed from \S+ step (\d+)", proc.stderr)
  assert resumed, proc.stderr[-3000:]
  assert int(resumed.group(1)) == max(steps) < in_flight
  assert not _tmp_dirs(os.path.join(workdir, "checkpoints"))  # cleaned up on restart
  _assert_same_run(workdir, reference)


def test_rerun_of_finished_run_is_a_no_op(tmp_path, env, reference):
  del tmp_path
  before = _final_params(reference)
  proc = _run(reference, 4, env)
  assert f"step {NUM_STEPS}" in proc.stderr
  after = _final_params(reference)
  for k in before:
    np.testing.assert_array_equal(before[k], after[k])
  assert os.path.exists(os.path.join(reference, "export", "drafter.json"))


ONLINE = "--config.data.online=True"


def test_online_kill_after_checkpoint_resumes_bitwise(tmp_path, env):
  """Online (the target in the train step): the same kill and resume, the same guarantee."""
  reference = str(tmp_path / "online_reference")
  _run(reference, 4, env, ONLINE)
  workdir = str(tmp_path / "online_killed")
  steps, _ = _kill_when(workdir, 4, env, lambda d: any(s >= 8 for s in _steps(d)), ONLINE)
  assert steps and max(steps) < NUM_STEPS
  proc = _run(workdir, 4, env, ONLINE)
  assert "Online training" in proc.stderr
  resumed = re.search(r"Resumed from \S+ step (\d+)", proc.stderr)
  assert resumed, proc.stderr[-3000:]
  assert int(resumed.group(1)) == max(steps)
  _assert_same_run(workdir, reference)
