"""scripts/smollm2_drafters.sh: which `python -m train` runs it starts, in which order.

The interpreter is replaced by a stub that records its arguments, so the test checks the
script's own logic (sizes, kinds, the fine-tune's starting point, LOOP=0) without training.
"""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "smollm2_drafters.sh")


def _runs(tmp_path, *, best=(), **env) -> list[list[str]]:
  log = tmp_path / "calls.txt"
  for run in best:  # runs whose engine evaluation exported a best step
    (tmp_path / "runs" / run / "best").mkdir(parents=True)
    (tmp_path / "runs" / run / "best" / "drafter.json").write_text("{}")
  stub = tmp_path / "python"
  stub.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
  stub.chmod(0o755)
  runs = tmp_path / "runs"
  proc = subprocess.run(["bash", SCRIPT, str(tmp_path / "data"), str(runs)], cwd=ROOT,
                        env=dict(os.environ, PYTHON=str(stub), DATASET="/d/set", **env),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  return [line.split() for line in log.read_text().splitlines()]


def _flag(call: list[str], name: str) -> str:
  return next(a.split("=", 1)[1] for a in call if a.startswith(f"--{name}="))


def test_each_size_and_kind_then_its_fine_tune_from_the_best_step(tmp_path):
  calls = _runs(tmp_path, best=["domino_all"], SIZES="1000 all", KINDS="block domino")
  configs = [c[c.index("--config") + 1] for c in calls]
  assert configs == ["configs/smollm2_block.py:cpu10k", "configs/smollm2_block.py:cpu10k_loop",
                     "configs/smollm2_domino.py:cpu10k", "configs/smollm2_domino.py:cpu10k_loop"
                     ] * 2
  workdirs = [c[c.index("--workdir") + 1] for c in calls]
  runs = str(tmp_path / "runs")
  assert workdirs[:2] == [f"{runs}/block_1000", f"{runs}/block_1000_loop"]
  assert workdirs[-1] == f"{runs}/domino_all_loop"
  assert [_flag(c, "config.data.max_examples") for c in calls] == ["1000"] * 4 + ["0"] * 4
  assert {_flag(c, "config.data.path") for c in calls} == {"/d/set"}
  # From the best step where the run exported one, else from the run's newest checkpoint.
  assert _flag(calls[1], "config.init_from") == f"{runs}/block_1000"
  assert _flag(calls[-1], "config.init_from") == f"{runs}/domino_all/best"


def test_loop_zero_runs_the_base_runs_only(tmp_path):
  calls = _runs(tmp_path, KINDS="dspark", LOOP="0",
                TRAIN_ARGS="--config.compute_dtype=bfloat16")
  assert len(calls) == 1 and calls[0][calls[0].index("--config") + 1] == (
      "configs/smollm2_dspark.py:cpu10k")
  assert "--config.compute_dtype=bfloat16" in calls[0]
