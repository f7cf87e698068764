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

RECIPES = ("cpu10k", "cpu10k_loop")


def get_config(recipe: str = "cpu10k") -> ConfigDict:
  return _smollm2_10k.head_drafter(recipe, kind="domino", gru_hidden_size=256, correction_rank=64)
