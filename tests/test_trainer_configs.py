"""Every shipped training config loads and validates; the recipe pairs agree."""

from __future__ import annotations

import importlib.util
import os

import pytest

import trainer_hooks
from dloop_jax import plain_values
from dloop_jax.training import config as config_lib

CONFIGS = sorted(f for f in os.listdir(os.path.join(trainer_hooks.ROOT, "configs"))
                 # data_*.py configure `python -m train.data`, not the trainer.
                 if f.endswith(".py") and not f.startswith(("_", "data_")))


def _config_module(name: str):
  spec = importlib.util.spec_from_file_location(f"_recipes_{name[:-3]}",
                                                os.path.join(trainer_hooks.ROOT, "configs", name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name, monkeypatch):
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)  # loop configs import their base
  config = trainer_hooks.load_config_file(name)
  config_lib.validate(config)
  assert config.drafter.kind in ("eagle3", "block", "dspark", "domino")
  if name.endswith("_loop.py"):
    assert config.objective == "loop_aware"


@pytest.mark.parametrize("name,loop_name", [
    ("tiny.py:eagle3", "tiny.py:eagle3_loop"), ("tiny.py:block", "tiny.py:block_loop"),
    ("tiny.py:dspark", "tiny.py:dspark_loop"), ("tiny.py:domino", "tiny.py:domino_loop"),
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
  for section in ("data", "optim", "eval", "checkpoint", "target"):
    assert heads[section].to_dict() == block[section].to_dict(), section
  # DSpark has its own distillation terms instead of the block objective's.
  for key, value in heads.objective_cfg.items():
    assert block.objective_cfg[key] == value, key
  assert heads.num_steps == block.num_steps
  for key, value in block.drafter.items():
    if key != "kind":
      assert heads.drafter[key] == value, key
  with pytest.raises(ValueError, match="Unknown recipe"):
    trainer_hooks.load_config_file(f"smollm2_{kind}.py", "cpu")


@pytest.mark.parametrize("name", ["smollm2_block.py", "smollm2_eagle3.py", "smollm2_dspark.py",
                                  "smollm2_domino.py"])
def test_smollm2_recipes_validate_and_state_the_distillation_keys(name, monkeypatch):
  """Every recipe of a SmolLM2 config loads, and reads completely: the distillation keys
  (kl_weight, feature_noise, ...) are listed at their defaults (hard cross-entropy)."""
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)
  module = _config_module(name)
  for recipe in module.RECIPES:
    c = module.get_config(recipe)
    config_lib.validate(c)
    keys = (("feature_noise",) if c.drafter.kind == "dspark"
            else tuple(config_lib.DISTILLATION_DEFAULTS))
    for key in keys:
      assert c.objective_cfg[key] == config_lib.DISTILLATION_DEFAULTS[key], (recipe, key)
    assert c.optim.weight_decay == 0.0
  with pytest.raises(ValueError, match="Unknown recipe"):
    module.get_config("cpu_dflash")


def test_block_ab_recipe_is_the_shipped_one_at_a_smaller_size(monkeypatch):
  """The A/B arms differ from the shipped recipe only in the size of the run and the
  held-out examples they are measured on (docs/drafters_smollm2.md)."""
  monkeypatch.syspath_prepend(trainer_hooks.ROOT)
  shipped = plain_values.to_plain(trainer_hooks.load_config_file("smollm2_block.py", "cpu10k"))
  ab = plain_values.to_plain(trainer_hooks.load_config_file("smollm2_block.py", "ab"))
  differ = {f"{section}.{key}" for section in shipped if isinstance(shipped[section], dict)
            for key in shipped[section] if shipped[section][key] != ab[section][key]}
  differ |= {k for k in shipped if not isinstance(shipped[k], dict) and shipped[k] != ab[k]}
  assert differ == {"data.seq_len", "data.heldout_examples", "objective_cfg.anchors_per_sequence",
                    "num_steps", "optim.warmup_steps", "eval.every_steps", "eval.patience", "eval.heldout_every_steps"}
  # The same anchor density: one anchor per 16 row positions.
  assert ab["data"]["seq_len"] // ab["objective_cfg"]["anchors_per_sequence"] == (
      shipped["data"]["seq_len"] // shipped["objective_cfg"]["anchors_per_sequence"])


def test_loop_aware_fine_tune_refuses_a_loop_aware_config():
  c = config_lib.loop_aware_fine_tune(config_lib.base_config(), num_steps=10, learning_rate=1e-4,
                                      warmup_steps=1)
  assert (c.objective, c.objective_cfg.max_stages, c.num_steps) == ("loop_aware", 3, 10)
  with pytest.raises(config_lib.ConfigError, match="already fine-tunes loop-aware"):
    config_lib.loop_aware_fine_tune(c, num_steps=10, learning_rate=1e-4, warmup_steps=1)


def test_config_files_are_locked():
  c = trainer_hooks.load_config_file("tiny.py", "eagle3")
  with pytest.raises(AttributeError, match="did you mean|Did you mean"):
    c.optim.learnig_rate = 1.0
