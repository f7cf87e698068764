"""Clear errors: config typos, a workdir of another drafter or target, mismatched data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

import trainer_hooks
from dloop_jax.errors import ConfigError, DrafterMismatchError
from dloop_jax.training import config as config_lib
from dloop_jax.training import trainer as trainer_lib
from train import __main__ as train_main

ROOT = trainer_hooks.ROOT


def _precheck_error(argv, capsys) -> str:
  with pytest.raises(SystemExit) as e:
    train_main.precheck(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


def test_override_typo_suggests_the_key(capsys):
  err = _precheck_error(["--config", "configs/tiny.py:eagle3", "--workdir", "/tmp/x",
                         "--config.optim.learnig_rate=1e-3"], capsys)
  assert "unknown config key 'optim.learnig_rate'" in err
  assert "did you mean 'optim.learning_rate'" in err


def test_config_file_typo_suggests_the_key(tmp_path, capsys):
  path = tmp_path / "bad.py"
  path.write_text(
      "from dloop_jax.training.config import base_config\n"
      "def get_config():\n"
      "  c = base_config()\n"
      "  c.optim.warmup_step = 3\n"
      "  return c\n")
  err = _precheck_error([f"--config={path}", "--workdir", "/tmp/x"], capsys)
  assert "warmup_step" in err and 'Did you mean "warmup_steps"' in err


def test_valid_command_line_passes_precheck():
  train_main.precheck(["--config", "configs/tiny.py:eagle3_loop", "--workdir", "/tmp/x",
                       "--config.optim.learning_rate=1e-3", "--config.drafter.block_size=2"])


def test_validate_catches_keys_added_to_an_unlocked_config():
  c = config_lib.base_config()
  c.unlock()
  c.checkpoint.evry_steps = 5
  with pytest.raises(ConfigError, match="did you mean 'checkpoint.every_steps'"):
    config_lib.validate(c)
  c = config_lib.base_config()
  with c.unlocked():
    c.objective = "ttt"
  with pytest.raises(ConfigError, match="objective must be one of"):
    config_lib.validate(c)


@pytest.fixture(scope="module")
def eagle_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("eagle"))
  trainer_lib.train(trainer_hooks.tiny_config(num_steps=4), workdir)
  return workdir


def test_workdir_of_another_drafter_kind(eagle_workdir):
  c = trainer_hooks.tiny_config(num_steps=8)
  c.drafter = ConfigDict(dict(kind="block", block_size=3))
  with pytest.raises(ConfigError, match="holds a 'eagle3' drafter; this config trains a 'block'"):
    trainer_lib.train(c, eagle_workdir)


def test_workdir_of_another_drafter_config(eagle_workdir):
  c = trainer_hooks.tiny_config(num_steps=8, drafter__block_size=5)
  with pytest.raises(ConfigError, match="block_size: checkpoint 3, config 5"):
    trainer_lib.train(c, eagle_workdir)


def test_workdir_of_another_target(eagle_workdir):
  # Same shapes, other weights.
  with pytest.raises(DrafterMismatchError, match=r"trained for target 'tiny\(seed=1"):
    trainer_lib.train(trainer_hooks.tiny_config(num_steps=8, target__seed=7), eagle_workdir)
  # Other shapes.
  c = trainer_hooks.tiny_config(num_steps=8)
  c.target.overrides = ConfigDict(dict(hidden_size=48))
  with pytest.raises(DrafterMismatchError, match="hidden_size"):
    trainer_lib.train(c, eagle_workdir)


def test_dataset_with_other_taps(tmp_path):
  c = trainer_hooks.tiny_config()
  c.data.options = ConfigDict(dict(taps=[1]))
  with pytest.raises(ConfigError, match=r"features of target layers \(1,\).*reads layers \(0, 1\)"):
    trainer_lib.train(c, str(tmp_path))


def test_batch_must_divide_the_mesh(tmp_path):
  c = trainer_hooks.tiny_config(data__batch_size=6, mesh__data=4)
  with pytest.raises(ConfigError, match="needs 4 devices|multiple of"):
    trainer_lib.train(c, str(tmp_path))


def test_cli_reports_errors_in_one_line(eagle_workdir):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "train", "--config", "configs/tiny.py:block",
       "--workdir", eagle_workdir, f"--config.hooks={trainer_hooks.STANDIN}",
       "--config.data.num_examples=64", "--config.data.seq_len=32"],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "holds a 'eagle3' drafter" in last
