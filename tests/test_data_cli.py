"""`python -m train.data`: builds both datasets from a config file."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import tensorflow_datasets as tfds

from dloop_jax.data import pipeline
from dloop_jax.data import tfds_utils

tfds.disable_progress_bar()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name, recipe=""):
  path = os.path.join(ROOT, "configs", name)
  spec = importlib.util.spec_from_file_location(f"_data_cfg_{name[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(recipe) if recipe else module.get_config()


def test_cli_builds_both_datasets(tmp_path):
  data_dir = str(tmp_path / "data")
  cmd = [sys.executable, "-m", "train.data", "--config", "configs/data_tiny.py:sharegpt",
         "--data_dir", data_dir, "--config.target_responses.num_prompts=8",
         "--config.target_responses.max_new_tokens=8", "--config.sharegpt.max_conversations=200",
         "--config.progress=False"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # TFDS prints a line or two before the summary.
  out = proc.stdout
  start = out.index("\n{\n") + 1
  summary = json.loads(out[start:out.rindex("\n}") + 2])
  assert summary["sharegpt"]["splits"]["train"] > 0
  assert sum(summary["sharegpt"]["dropped"].values()) >= 0
  tr = summary["target_responses"]
  assert tr["examples"] == 8 and tr["taps"] == [0, 1]
  assert tr["disk_bytes_per_1000_tokens"] > 0
  assert "--config.data.path=" in proc.stdout
  pipeline.check_dataset_matches(tr["dataset_dir"], taps=(0, 1),
                                 target_name="tiny(seed=1,init_std=0.3)")


def test_cli_answers_only_then_features_from_the_stored_answers(tmp_path):
  base = [sys.executable, "-m", "train.data", "--config", "configs/data_tiny.py",
          "--data_dir", str(tmp_path / "data"), "--config.target_responses.num_prompts=8",
          "--config.target_responses.max_new_tokens=8", "--config.progress=False",
          f"--config.responses_dir={tmp_path / 'answers'}", "--only", "target_responses"]

  def run(*extra):
    proc = subprocess.run(base + list(extra), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    start = 0 if out.startswith("{\n") else out.index("\n{\n") + 1
    return json.loads(out[start:out.rindex("\n}") + 2]), out

  answered, out = run("--answers_only")
  assert answered["target_responses"]["chunks_generated"] == 1
  assert "--config.data.path=" not in out  # no dataset yet
  assert not os.path.exists(tmp_path / "data" / "target_responses")
  built, out = run()
  tr = built["target_responses"]
  assert tr["chunks_from_stored_answers"] == 1 and tr["chunks_generated"] == 0
  assert tr["examples"] == 8 and "--config.data.path=" in out


def test_bad_config_value_is_reported(tmp_path):
  cmd = [sys.executable, "-m", "train.data", "--config", "configs/data_tiny.py",
         "--data_dir", str(tmp_path), "--config.target_responses.prompt_source=web"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "prompt_source must be one of" in proc.stderr


def test_configs_load_and_default_data_dir(monkeypatch, tmp_path):
  for name, recipe in (("data_smollm2.py", ""), ("data_smollm2.py", "small"),
                       ("data_tiny.py", ""), ("data_tiny.py", "sharegpt")):
    c = _config(name, recipe)
    assert set(c.datasets) <= {"sharegpt", "target_responses"}
  assert tuple(_config("data_smollm2.py").target_responses.taps) == (1, 14, 26)
  monkeypatch.delenv("DLOOP_DATA_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert tfds_utils.default_data_dir() == os.path.join(str(tmp_path), "dloop_jax", "datasets")
  monkeypatch.setenv("DLOOP_DATA_DIR", "/data/x")
  assert tfds_utils.default_data_dir() == "/data/x"
