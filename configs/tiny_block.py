"""Block (DFlash-style) drafter on the tiny random target (tests, examples; < 2 min on a CPU).

    python -m train --config configs/tiny_block.py --workdir /tmp/tiny_block
    python -m train --config configs/tiny_block.py:loop --workdir /tmp/tiny_block_loop \
        --config.init_from=/tmp/tiny_block

The second command is the recipe's loop-aware fine-tune of the first run.
"""

from dloop_jax.training.config import base_config, loop_aware_fine_tune, objective_settings
from ml_collections import ConfigDict


def get_config(recipe: str = "") -> ConfigDict:
  c = base_config()
  c.target.model = "tiny"
  c.target.seed = 1
  c.drafter = ConfigDict(dict(kind="block", block_size=4, num_layers=1))
  c.objective = "block"
  c.objective_cfg = objective_settings(anchors_per_sequence=4)
  c.data.source = "tiny_random"
  c.data.num_examples = 256
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.num_steps = 300
  c.log_every_steps = 10
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 20
  c.checkpoint.every_steps = 100
  if recipe == "loop":
    loop_aware_fine_tune(c, num_steps=100, learning_rate=1e-3, warmup_steps=10)
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '' or 'loop'.")
  return c
