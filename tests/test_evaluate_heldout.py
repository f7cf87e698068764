"""`python -m train.evaluate` reports the teacher-forced held-out metric beside engine τ."""

from __future__ import annotations

import json
import os

import pytest

import trainer_hooks
from dloop_jax.training import hooks as hooks_lib
from dloop_jax.training import metrics_writer
from dloop_jax.training import trainer as trainer_lib
from train import evaluate


def test_heldout_metric_beside_engine_tau(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(trainer_hooks.ROOT)
  c = trainer_hooks.load_config_file("tiny.py", "block")
  c.num_steps, c.checkpoint.every_steps = 4, 4
  c.data.num_examples, c.data.heldout_examples = 40, 8
  c.eval.heldout_every_steps = 4
  c.progress_bar, c.tensorboard = False, False
  workdir = str(tmp_path / "run")
  trainer_lib.train(c, workdir)
  with open(os.path.join(workdir, metrics_writer.METRICS_FILE)) as f:
    logged = [m for m in map(json.loads, f) if "heldout_tau" in m][-1]

  args = evaluate._parse([  # pylint: disable=protected-access
      "--drafters", workdir, "--prompts", "random", "--prompts-per-category", "2",
      "--max-new-tokens", "6", "--modes", "sd", "--heldout-data", os.path.join(workdir, "data"),
      "--heldout-examples", "8", "--heldout-config", "configs/tiny.py:block"])
  target = hooks_lib.default_build_target(c.target)
  (row,) = evaluate.evaluate(args, target=target)
  # The same drafts on the same never-trained-on examples as the run's own evaluation.
  for key in ("heldout_tau", "heldout_tau_se", "heldout_acc_1", "heldout_acc_4_se"):
    assert row[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-7), key
  assert row["heldout_examples"] == 8 and row["heldout_tau_se"] > 0
  assert row["engine_tau_sd"] >= 1.0
  table = evaluate._table([row], args.modes)  # pylint: disable=protected-access
  assert "heldout τ ± SE" in table and "τ sd" in table
  assert f"{row['heldout_tau']:.3f} ± {row['heldout_tau_se']:.3f}" in table
  capsys.readouterr()

  # Held-out only: no engine run, the held-out columns alone.
  args = evaluate._parse([  # pylint: disable=protected-access
      "--drafters", workdir, "--no-engine", "--heldout-data", os.path.join(workdir, "data"),
      "--heldout-examples", "4", "--heldout-config", "configs/tiny.py:block"])
  (row,) = evaluate.evaluate(args, target=target)
  assert row["heldout_examples"] == 4 and "engine_tau_sd" not in row
  assert "τ sd" not in evaluate._table([row], args.modes)  # pylint: disable=protected-access
