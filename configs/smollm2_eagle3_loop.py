"""EAGLE-3 for SmolLM2-135M-Instruct, step 2 of the recipe: loop-aware fine-tune.

Starts from the normally trained drafter (`--config.init_from=<workdir of
configs/smollm2_eagle3.py>` or its export); see configs/smollm2_eagle3.py.
"""

from configs import smollm2_eagle3


def get_config():
  return smollm2_eagle3.get_config("loop")
