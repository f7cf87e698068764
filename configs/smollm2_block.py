"""Block (DFlash-style) drafter for SmolLM2-135M-Instruct: the shipped recipe and its A/B.

The shipped drafter (`smollm2-135m-instruct-block`, docs/drafters_smollm2.md):

    python -m train --config configs/smollm2_block.py:cpu10k --workdir runs/block_all \
        --config.data.path=<dataset dir> --config.compute_dtype=bfloat16
    python -m train --config configs/smollm2_block.py:cpu10k_loop --workdir runs/block_all_loop \
        --config.data.path=<dataset dir> --config.init_from=runs/block_all/best

(or scripts/smollm2_drafters.sh). `ab` is that recipe at the size of the
training-objective A/B in docs/drafters_smollm2.md (shorter rows and schedule,
held-out examples measured every 50 steps); its arms are flags
(`--config.objective_cfg.kl_weight=1 --config.objective_cfg.hard_weight=0`, ...).
The recipe without a name is the schedule for accelerators (larger drafter,
20k steps; step 2: configs/smollm2_block_loop.py), not trained yet.
"""

from dloop_jax.training.config import base_config, loop_aware_fine_tune, objective_settings
from ml_collections import ConfigDict

from configs import _smollm2_10k

RECIPES = ("", "loop", "cpu10k", "cpu10k_loop", "ab")


def get_config(recipe: str = "") -> ConfigDict:
  if recipe not in RECIPES:
    raise ValueError(f"Unknown recipe {recipe!r}; use one of {', '.join(map(repr, RECIPES))}.")
  c = base_config()
  c.target.model = "smollm2-135m-instruct"
  c.target.dtype = "float32"
  c.data.source = "path"
  c.data.path = ""  # a dataset built with `python -m train.data`
  c.objective = "block"
  c.optim.grad_clip_norm = 1.0
  # The distillation keys at their defaults (hard cross-entropy on the target's
  # answer tokens): kl_weight / tv_weight to the target's top-k (a dataset built
  # with target_topk, or data.online), feature_noise on the taps.
  if recipe in ("", "loop"):
    c.drafter = ConfigDict(dict(kind="block", block_size=8, num_layers=3))
    c.objective_cfg = objective_settings(anchors_per_sequence=16)
    c.data.batch_size = 16
    c.data.seq_len = 1024
    c.num_steps = 20_000
    c.log_every_steps = 50
    c.optim.learning_rate = 3e-4
    c.optim.warmup_steps = 500
    c.checkpoint.every_steps = 1000
    c.checkpoint.keep = 3
    if recipe == "loop":
      loop_aware_fine_tune(c, num_steps=5_000, learning_rate=1e-4, warmup_steps=100)
    return c
  # The shipped drafter, sized for a CPU verifier: gamma = 4 (verification
  # widths 5 / 9 / 13), 2 layers, the target's head (restricted to a draft
  # vocabulary after training, python -m train.export), the mask input = the
  # embedding of <empty_output> (id 16), a reserved token chat text never holds.
  c.drafter = ConfigDict(dict(kind="block", block_size=4, num_layers=2, draft_vocab_size=0,
                              mask_token_id=16))
  c.objective_cfg = objective_settings(anchors_per_sequence=64)
  _smollm2_10k.apply(c, learning_rate=1e-3, loop=recipe == "cpu10k_loop",
                     loop_learning_rate=3e-4)
  if recipe == "ab":
    # Equal data and steps for every arm, sized to a 2-core CPU (about 15
    # minutes an arm): 512-token rows (32 anchors each: the same anchor
    # density), 300 steps, the last 128 examples held out and measured
    # teacher-forced every 100 steps; engine tau after training
    # (python -m train.evaluate).
    c.data.seq_len = 512
    c.objective_cfg.anchors_per_sequence = 32
    c.data.heldout_examples = 128
    c.num_steps = 300
    c.optim.warmup_steps = 30
    c.eval.every_steps = 0
    c.eval.patience = 0
    c.eval.heldout_every_steps = 100
  return c
