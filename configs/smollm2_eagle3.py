"""EAGLE-3 drafter for SmolLM2-135M-Instruct (the default target), step 1 of the recipe.

    python -m train.data ...                       # the dataset (target features)
    python -m train --config configs/smollm2_eagle3.py --workdir runs/smollm2_eagle3 \
        --config.data.path=<dataset dir>
    python -m train --config configs/smollm2_eagle3_loop.py --workdir runs/smollm2_eagle3_loop \
        --config.data.path=<dataset dir> --config.init_from=runs/smollm2_eagle3

The drafter shipped in the package was trained on a 2-core CPU with the `cpu`
and `cpu_loop` recipes (`--config configs/smollm2_eagle3.py:cpu`); see
docs/drafters_smollm2.md for the exact commands.

On accelerators (and CPUs with bfloat16 matrix units) add
`--config.compute_dtype=bfloat16` (mixed precision) and size the mesh, e.g.
`--config.mesh.data=-1 --config.mesh.fsdp=4`.
"""

from dloop_jax.training.config import base_config, loop_aware_fine_tune, objective_settings
from ml_collections import ConfigDict

from configs import _smollm2_10k

RECIPES = ("", "loop", "cpu", "cpu_loop", "cpu10k", "cpu10k_loop")


def get_config(recipe: str = "") -> ConfigDict:
  c = base_config()
  c.target.model = "smollm2-135m-instruct"
  c.target.dtype = "float32"
  # Taps default to EAGLE-3's low / middle / high layers of the 30-layer target.
  c.drafter = ConfigDict(dict(kind="eagle3", block_size=4))
  c.objective = "eagle3_ttt"
  # The distillation keys at their defaults (hard cross-entropy); EAGLE-3 alone
  # has the feature regression term (online).
  c.objective_cfg = objective_settings(ttt_steps=7, step_decay=0.8)
  c.data.source = "path"
  c.data.path = ""  # a dataset built with `python -m train.data`
  c.data.batch_size = 16
  c.data.seq_len = 1024
  c.num_steps = 20_000
  c.log_every_steps = 50
  c.optim.learning_rate = 1e-4
  c.optim.warmup_steps = 500
  c.optim.grad_clip_norm = 0.5
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep = 3
  if recipe == "loop":
    # About one epoch of fine-tuning from the normally trained drafter.
    loop_aware_fine_tune(c, num_steps=5_000, learning_rate=3e-5, warmup_steps=100)
  elif recipe in ("cpu", "cpu_loop"):
    # The shipped drafter: a short schedule that fits a 2-core CPU (about two
    # epochs of 1,000 regenerated ShareGPT answers, then a loop-aware pass).
    # TTT unrolls one stage (gamma = 4 steps); stages beyond it are what the
    # loop-aware fine-tune teaches.
    c.data.batch_size = 4
    c.data.seq_len = 512
    c.data.options = ConfigDict(dict(pack=True))
    c.objective_cfg.ttt_steps = 4
    c.num_steps = 260
    c.log_every_steps = 10
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 15
    c.checkpoint.every_steps = 30
    c.checkpoint.keep = 2
    if recipe == "cpu_loop":
      # (The loop-aware objective unrolls its stages itself: ttt_steps is unused.)
      loop_aware_fine_tune(c, num_steps=60, learning_rate=3e-4, warmup_steps=5)
      c.data.seq_len = 256
  elif recipe in ("cpu10k", "cpu10k_loop"):
    # configs/_smollm2_10k.py; the loop-aware step on 512-token rows, twice as many.
    c.objective_cfg.ttt_steps = 4
    _smollm2_10k.apply(c, learning_rate=5e-4, loop=recipe == "cpu10k_loop",
                       loop_learning_rate=1.5e-4)
    if recipe == "cpu10k_loop":
      c.data.seq_len, c.data.batch_size = 512, 8
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '', 'loop', 'cpu', 'cpu_loop', 'cpu10k' or"
                     " 'cpu10k_loop'.")
  return c
