"""Every drafter kind on the tiny random target (tests, examples; < 2 min a run on a CPU).

The recipe names the drafter, `<kind>_loop` its loop-aware fine-tune:

    python -m train --config configs/tiny.py:eagle3 --workdir /tmp/tiny_eagle3
    python -m train --config configs/tiny.py:eagle3_loop --workdir /tmp/tiny_eagle3_loop \
        --config.init_from=/tmp/tiny_eagle3

with `block` (DFlash-style), `dspark` (block backbone + Markov and confidence
heads) or `domino` (block backbone + GRU correction head) for `eagle3`. The
kinds share the target, data, schedule and optimizer; they differ in the
drafter and its objective (`DRAFTERS`). Without a recipe: `eagle3`.
"""

from dloop_jax.training.config import base_config, loop_aware_fine_tune, objective_settings
from ml_collections import ConfigDict

# kind -> (drafter settings, objective, objective settings).
DRAFTERS = {
    "eagle3": (dict(kind="eagle3", block_size=3), "eagle3_ttt",
               dict(ttt_steps=3, step_decay=0.8)),
    "block": (dict(kind="block", block_size=4, num_layers=1), "block",
              dict(anchors_per_sequence=4)),
    "dspark": (dict(kind="dspark", block_size=4, num_layers=1, markov_rank=16), "dspark",
               dict(distillation=False, anchors_per_sequence=4)),
    "domino": (dict(kind="domino", block_size=4, num_layers=1, gru_hidden_size=32,
                    correction_rank=16), "domino", dict(anchors_per_sequence=4)),
}
RECIPES = tuple(f"{kind}{loop}" for kind in DRAFTERS for loop in ("", "_loop"))


def get_config(recipe: str = "eagle3") -> ConfigDict:
  if recipe not in RECIPES:
    raise ValueError(f"Unknown recipe {recipe!r}; use one of {', '.join(map(repr, RECIPES))}.")
  kind, _, loop = recipe.partition("_")
  drafter, objective, objective_cfg = DRAFTERS[kind]
  c = base_config()
  c.target.model = "tiny"
  c.target.seed = 1
  c.drafter = ConfigDict(drafter)
  c.objective = objective
  c.objective_cfg = objective_settings(**objective_cfg)
  c.data.source = "tiny_random"
  c.data.num_examples = 256
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.num_steps = 300
  c.log_every_steps = 10
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 20
  c.checkpoint.every_steps = 100
  if loop:
    loop_aware_fine_tune(c, num_steps=100, learning_rate=1e-3, warmup_steps=10)
  return c
