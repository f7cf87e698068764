"""Drafter export / load_drafter, and the recipe's `init_from` (train, then loop-aware fine-tune)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

import trainer_hooks
import trainer_standin
from dloop_jax import flat_state
from dloop_jax.drafters import io as drafter_io
from dloop_jax.drafters import registry
from dloop_jax.drafters import variables
from dloop_jax.errors import ConfigError, DrafterMismatchError, ModelLoadError
from dloop_jax.models.transformer import tiny_target
from dloop_jax.recorded_paths import recorded_path
from dloop_jax.training import checkpointing as ckpt_lib
from dloop_jax.training import trainer as trainer_lib


@pytest.fixture(autouse=True)
def standin_registry(monkeypatch):
  # load_drafter rebuilds through registry.build_drafter.
  monkeypatch.setattr(registry, "build_drafter", trainer_standin.build_drafter)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  result = trainer_lib.train(trainer_hooks.tiny_config(num_steps=8), workdir)
  return workdir, result


def _checkpoint_params(workdir: str, step: int) -> dict[str, np.ndarray]:
  with ckpt_lib.ocp.StandardCheckpointer() as c:
    out = c.restore(os.path.join(workdir, "checkpoints", str(step), "params"))
  return {k: np.asarray(v) for k, v in out.items()}


def _flat_params(drafter) -> dict[str, np.ndarray]:
  _, params, _, _, _ = variables.split_drafter(drafter)
  return {k: np.asarray(v) for k, v in flat_state.flat_values(params).items()}


def test_export_contents(run):
  workdir, result = run
  assert result.export_dir == os.path.join(workdir, "export")
  info = json.load(open(os.path.join(result.export_dir, "drafter.json")))
  assert info["kind"] == "eagle3"
  assert info["drafter_config"] == {"kind": "eagle3", "block_size": 3}
  assert info["target"]["name"].startswith("tiny(seed=1")
  assert info["target"]["fingerprint"] == {"vocab_size": 64, "hidden_size": 32, "num_layers": 2}
  assert info["taps"] == [0, 1]
  assert {d["dtype"] for d in info["params"].values()} == {"bfloat16"}
  assert "embed" not in info["params"]  # frozen target weights are not stored
  assert info["metrics"]["loss"] > 0 and info["extra"]["step"] == 8
  # Outside the working directory the workdir is recorded by its last two components only.
  assert info["extra"]["workdir"] == "/".join(workdir.split(os.sep)[-2:])


def test_export_files_carry_no_machine_path(run):
  """An export is copied and shipped: no file in it names the directory it was written to
  (orbax's commit marker did)."""
  _, result = run
  for folder, _, files in os.walk(result.export_dir):
    for name in files:
      with open(os.path.join(folder, name), "rb") as f:
        assert result.export_dir.encode() not in f.read(), os.path.join(folder, name)
  marker = os.path.join(result.export_dir, "arrays", "commit_success.txt")
  assert not os.path.exists(marker) or open(marker).read().endswith(" arrays")


def test_recorded_paths_carry_no_machine_paths(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert recorded_path(str(tmp_path / "runs" / "a")) == os.path.join("runs", "a")
  assert recorded_path("runs/a/") == os.path.join("runs", "a")
  assert recorded_path("/elsewhere/x/runs/b") == "runs/b"
  from dloop_jax.recorded_paths import recorded_name  # pylint: disable=g-import-not-at-top
  assert recorded_name("smollm2-135m-instruct-block") == "smollm2-135m-instruct-block"
  assert recorded_name("/elsewhere/x/runs/b") == "runs/b"


def test_load_drafter_round_trip(run):
  workdir, _ = run
  target = tiny_target(seed=1)
  final = _checkpoint_params(workdir, 8)
  for source in (os.path.join(workdir, "export"), workdir):
    drafter = drafter_io.load_drafter(source, target=target)
    got = _flat_params(drafter)
    assert sorted(got) == sorted(final)
    for k, v in final.items():
      assert got[k].dtype == np.float32
      np.testing.assert_array_equal(got[k], np.asarray(jnp.asarray(v).astype(jnp.bfloat16),
                                                       np.float32))
    np.testing.assert_array_equal(np.asarray(drafter.embed[...]), np.asarray(target.embed[...]))


def test_load_drafter_for_another_target(run):
  workdir, _ = run
  with pytest.raises(DrafterMismatchError, match="vocab_size: drafter expects 64, target has 128"):
    drafter_io.load_drafter(workdir, target=tiny_target(seed=1, vocab_size=128))


def test_load_unknown_drafter():
  with pytest.raises(ModelLoadError, match="not a shipped drafter"):
    drafter_io.load_drafter("no-such-drafter", target=tiny_target(seed=1))


def test_truncated_export_is_reported(run, tmp_path):
  workdir, _ = run
  broken = tmp_path / "broken"
  os.makedirs(broken)
  info = json.load(open(os.path.join(workdir, "export", "drafter.json")))
  (broken / "drafter.json").write_text(json.dumps(info))
  with pytest.raises(ModelLoadError, match="truncated or corrupt"):
    drafter_io.load_drafter(str(broken), target=tiny_target(seed=1))


def test_init_from_workdir_and_export(run):
  workdir, _ = run
  final = _checkpoint_params(workdir, 8)
  t = trainer_lib.Trainer(trainer_hooks.tiny_config(recipe="loop"))
  assert "step 8" in t.init_from(workdir)
  for k, v in final.items():
    np.testing.assert_array_equal(np.asarray(t.params[k]), v)
  t = trainer_lib.Trainer(trainer_hooks.tiny_config(recipe="loop"))
  t.init_from(os.path.join(workdir, "export"))
  for k, v in final.items():
    np.testing.assert_array_equal(
        np.asarray(t.params[k]), np.asarray(jnp.asarray(v).astype(jnp.bfloat16), np.float32))


def test_init_from_another_drafter_is_an_error(run):
  workdir, _ = run
  c = trainer_hooks.tiny_config(recipe="loop")
  c.drafter = ConfigDict(dict(kind="block", block_size=3))
  with pytest.raises(ConfigError, match="holds a 'eagle3' drafter"):
    trainer_lib.Trainer(c).init_from(workdir)
  with pytest.raises(ConfigError, match="neither a training workdir"):
    trainer_lib.Trainer(trainer_hooks.tiny_config()).init_from("/nonexistent")


def test_recipe_loop_aware_fine_tune(run, tmp_path):
  workdir, _ = run
  c = trainer_hooks.tiny_config(recipe="loop", num_steps=4, init_from=workdir)
  assert c.objective == "loop_aware"
  fine = str(tmp_path / "loop")
  result = trainer_lib.train(c, fine)
  assert result.init_from and "step 8" in result.init_from and result.step == 4
  info = json.load(open(os.path.join(result.export_dir, "drafter.json")))
  assert info["extra"]["objective"] == "loop_aware"
  assert info["extra"]["init_from"] == result.init_from
  # Rerun resumes the fine-tune from its own checkpoint, not from init_from.
  again = trainer_lib.train(c, fine)
  assert again.resumed_from == 4 and again.init_from is None
