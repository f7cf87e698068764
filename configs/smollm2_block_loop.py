"""Block drafter for SmolLM2-135M-Instruct, step 2 of the recipe: loop-aware fine-tune.

Starts from the normally trained drafter (`--config.init_from=<workdir of
configs/smollm2_block.py>` or its export); see configs/smollm2_block.py.
"""

from configs import smollm2_block


def get_config():
  return smollm2_block.get_config("loop")
