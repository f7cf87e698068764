"""DSpark drafter (block backbone + Markov and confidence heads) for SmolLM2-135M-Instruct.

The block drafter's `cpu10k` recipe (configs/smollm2_block.py) with DSpark's
heads, so that the two compare on the same data, rows, steps and learning rate:

    python -m train --config configs/smollm2_dspark.py:cpu10k --workdir runs/dspark_all \
        --config.data.path=<dataset dir>
    python -m train --config configs/smollm2_dspark.py:cpu10k_loop --workdir runs/dspark_all_loop \
        --config.data.path=<dataset dir> --config.init_from=runs/dspark_all/best

(or `KINDS=dspark bash scripts/smollm2_drafters.sh DATA RUNS`). The head
ablations are flags: `--config.drafter.markov_rank=0`,
`--config.drafter.enable_confidence_head=False`. On a dataset built with
`--config.target_responses.target_topk=16` (what the script builds when KINDS
holds dspark) the L1 term and the confidence target use the target's top-16
distribution (docs/drafters.md); on one without, the one-hot of the answer
token: under greedy verification that is the acceptance event itself.
"""

from ml_collections import ConfigDict

from configs import _smollm2_10k

RECIPES = ("cpu10k", "cpu10k_loop")


def get_config(recipe: str = "cpu10k") -> ConfigDict:
  return _smollm2_10k.head_drafter(recipe, kind="dspark", markov_rank=64, enable_confidence_head=True)
