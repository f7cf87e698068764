"""Every shipped training config loads and validates; the recipe pairs agree."""

from __future__ import annotations

import os

import pytest

import trainer_hooks
from dloop_jax.training import config as config_lib

CONFIGS = sorted(f for f in os.listdir(os.path.join(trainer_hooks.ROOT, "configs"))
                 # data_*.py configure `python -m train.data`, not the trainer.
                 if f.endswith(".py") and not f.startswith(("_", "data_")))


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name, monkeypatch):
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)  # loop configs import their base
  config = trainer_hooks.load_config_file(name)
  config_lib.validate(config)
  assert config.drafter.kind in ("eagle3", "block", "dspark", "domino")
  if name.endswith("_loop.py"):
    assert config.objective == "loop_aware"


@pytest.mark.parametrize("name,loop_name", [
    ("tiny_eagle3.py", "tiny_eagle3.py:loop"), ("tiny_block.py", "tiny_block.py:loop"),
    ("tiny_dspark.py", "tiny_dspark.py:loop"), ("tiny_domino.py", "tiny_domino.py:loop"),
    ("smollm2_eagle3.py", "smollm2_eagle3_loop.py"), ("smollm2_block.py", "smollm2_block_loop.py"),
    ("smollm2_eagle3.py:cpu10k", "smollm2_eagle3.py:cpu10k_loop"),
    ("smollm2_block.py:cpu10k", "smollm2_block.py:cpu10k_loop"),
    ("smollm2_dspark.py:cpu10k", "smollm2_dspark.py:cpu10k_loop"),
    ("smollm2_domino.py:cpu10k", "smollm2_domino.py:cpu10k_loop")])
def test_loop_recipe_keeps_the_drafter(name, loop_name, monkeypatch):
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)
  base = trainer_hooks.load_config_file(*name.split(":"))
  loop = trainer_hooks.load_config_file(*loop_name.split(":"))
  config_lib.validate(base)
  config_lib.validate(loop)
  assert loop.objective == "loop_aware"
  assert loop.drafter.to_dict() == base.drafter.to_dict()  # init_from must fit
  assert loop.target.to_dict() == base.target.to_dict()
  # The fine-tune keeps the first step's objective settings, as its base objective's.
  assert loop.objective_cfg.base_objective == base.objective
  for key, value in base.objective_cfg.items():
    assert loop.objective_cfg[key] == value


@pytest.mark.parametrize("kind", ["dspark", "domino"])
def test_head_drafters_share_the_block_recipe(kind, monkeypatch):
  """SmolLM2 DSpark / Domino compare with the block drafter: same data, rows, steps, backbone."""
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)
  block = trainer_hooks.load_config_file("smollm2_block.py", "cpu10k")
  heads = trainer_hooks.load_config_file(f"smollm2_{kind}.py", "cpu10k")
  for section in ("data", "optim", "eval", "checkpoint", "target", "objective_cfg"):
    assert heads[section].to_dict() == block[section].to_dict(), section
  assert heads.num_steps == block.num_steps
  for key, value in block.drafter.items():
    if key != "kind":
      assert heads.drafter[key] == value, key
  with pytest.raises(ValueError, match="Unknown recipe"):
    trainer_hooks.load_config_file(f"smollm2_{kind}.py", "cpu")


def test_loop_aware_fine_tune_refuses_a_loop_aware_config():
  c = config_lib.loop_aware_fine_tune(config_lib.base_config(), num_steps=10, learning_rate=1e-4,
                                      warmup_steps=1)
  assert (c.objective, c.objective_cfg.max_stages, c.num_steps) == ("loop_aware", 3, 10)
  with pytest.raises(config_lib.ConfigError, match="already fine-tunes loop-aware"):
    config_lib.loop_aware_fine_tune(c, num_steps=10, learning_rate=1e-4, warmup_steps=1)


def test_config_files_are_locked():
  c = trainer_hooks.load_config_file("tiny_eagle3.py")
  with pytest.raises(AttributeError, match="did you mean|Did you mean"):
    c.optim.learnig_rate = 1.0
