"""Block (DFlash-style) drafter for SmolLM2-135M-Instruct, step 1 of the recipe.

    python -m train --config configs/smollm2_block.py --workdir runs/smollm2_block \
        --config.data.path=<dataset dir>
    python -m train --config configs/smollm2_block_loop.py --workdir runs/smollm2_block_loop \
        --config.data.path=<dataset dir> --config.init_from=runs/smollm2_block
"""

from dloop_jax.training.config import base_config, loop_aware_fine_tune
from ml_collections import ConfigDict

from configs import _smollm2_10k


def get_config(recipe: str = "") -> ConfigDict:
  c = base_config()
  c.target.model = "smollm2-135m-instruct"
  c.target.dtype = "float32"
  c.drafter = ConfigDict(dict(kind="block", block_size=8, num_layers=3))
  c.objective = "block"
  c.objective_cfg = ConfigDict(dict(anchors_per_sequence=16))
  c.data.source = "path"
  c.data.path = ""
  c.data.batch_size = 16
  c.data.seq_len = 1024
  c.num_steps = 20_000
  c.log_every_steps = 50
  c.optim.learning_rate = 3e-4
  c.optim.warmup_steps = 500
  c.optim.grad_clip_norm = 1.0
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep = 3
  if recipe == "loop":
    loop_aware_fine_tune(c, num_steps=5_000, learning_rate=1e-4, warmup_steps=100)
  elif recipe in ("cpu", "cpu_loop", "cpu_dflash"):
    # The shipped drafter: sized for a CPU verifier (gamma = 4: verification
    # widths 5 / 9 / 13), 2 layers, a reduced 8,192-token head; a short
    # schedule (about ten epochs of 1,000 regenerated ShareGPT answers; the
    # block objective's cheaper steps afford more of them than EAGLE-3's TTT).
    c.drafter = ConfigDict(dict(kind="block", block_size=4, num_layers=2,
                                draft_vocab_size=8192))
    c.objective_cfg = ConfigDict(dict(anchors_per_sequence=32))
    c.data.batch_size = 8
    c.data.seq_len = 512
    c.data.options = ConfigDict(dict(pack=True))
    c.num_steps = 700
    c.log_every_steps = 10
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 20
    c.checkpoint.every_steps = 50
    c.checkpoint.keep = 2
    if recipe == "cpu_loop":
      loop_aware_fine_tune(c, num_steps=150, learning_rate=3e-4, warmup_steps=5)
    elif recipe == "cpu_dflash":
      # The shipped drafter in DFlash's form: the target's whole head and the
      # mask input = the embedding of <empty_output> (id 16), a reserved token
      # chat text never holds (its row is the untrained one ids 5 and 7..16
      # share). Loop-aware fine-tune of the converted cpu_loop drafter
      # (scripts/tie_block_mask.py), see docs/drafters_smollm2.md.
      c.drafter = ConfigDict(dict(kind="block", block_size=4, num_layers=2,
                                  draft_vocab_size=0, mask_token_id=16))
      loop_aware_fine_tune(c, num_steps=150, learning_rate=3e-4, warmup_steps=5)
  elif recipe in ("cpu10k", "cpu10k_loop"):
    # configs/_smollm2_10k.py, with the shipped drafter's DFlash form (gamma = 4,
    # 2 layers, the target's head, mask = embedding of <empty_output>) and 64
    # anchors per 1,024-token row.
    c.drafter = ConfigDict(dict(kind="block", block_size=4, num_layers=2, draft_vocab_size=0,
                                mask_token_id=16))
    c.objective_cfg = ConfigDict(dict(anchors_per_sequence=64))
    _smollm2_10k.apply(c, learning_rate=1e-3, loop=recipe == "cpu10k_loop",
                       loop_learning_rate=3e-4)
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '', 'loop', 'cpu', 'cpu_loop', 'cpu_dflash',"
                     " 'cpu10k' or 'cpu10k_loop'.")
  return c
