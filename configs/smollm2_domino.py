"""Domino drafter (block backbone + GRU correction head) for SmolLM2-135M-Instruct.

The block drafter's `cpu10k` recipe (configs/smollm2_block.py) with Domino's
correction head and its base-anchored curriculum, so that the two compare on
the same data, rows, steps and learning rate:

    python -m train --config configs/smollm2_domino.py:cpu10k --workdir runs/domino_all \
        --config.data.path=<dataset dir>
    python -m train --config configs/smollm2_domino.py:cpu10k_loop --workdir runs/domino_all_loop \
        --config.data.path=<dataset dir> --config.init_from=runs/domino_all/best

(or `KINDS=domino bash scripts/smollm2_drafters.sh DATA RUNS`). The head's
ablation needs no second run: the trained drafter's base logits are the
backbone alone (`DominoDrafter.corrected_logits` returns both).
"""

from ml_collections import ConfigDict

from configs import _smollm2_10k
from dloop_jax.training.config import base_config


def get_config(recipe: str = "cpu10k") -> ConfigDict:
  if recipe not in ("cpu10k", "cpu10k_loop"):
    raise ValueError(f"Unknown recipe {recipe!r}; use 'cpu10k' or 'cpu10k_loop'.")
  c = base_config()
  c.target.model = "smollm2-135m-instruct"
  c.target.dtype = "float32"
  c.drafter = ConfigDict(dict(kind="domino", block_size=4, num_layers=2, draft_vocab_size=0,
                              mask_token_id=16, gru_hidden_size=256, correction_rank=64))
  c.objective = "domino"
  c.objective_cfg = ConfigDict(dict(anchors_per_sequence=64))
  c.data.source = "path"
  c.data.path = ""
  c.optim.grad_clip_norm = 1.0
  return _smollm2_10k.apply(c, learning_rate=1e-3, loop=recipe == "cpu10k_loop",
                            loop_learning_rate=3e-4)
