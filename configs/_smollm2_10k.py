"""The settings the SmolLM2 drafters' `cpu10k` recipes share (configs/smollm2_*.py).

The 10k-prompt dataset (configs/data_smollm2.py:10k) on a 2-core CPU, in runs
of a few hours that resume (scripts/smollm2_drafters.sh): packed 1,024-token
rows, 2,400 steps (about 3 epochs: the 10k answers are ~3.1 M tokens, 4,096 a
step), engine tau measured every 200 steps on 9 benchmark prompts, the best
step kept, and the run stopped after 4 evaluations (800 steps) without a
better one (what ends the small subsets of the data-scaling curve, which
overfit long before 2,400 steps); the loop-aware fine-tune is 300 steps,
evaluated every 100.
"""

from ml_collections import ConfigDict

from dloop_jax.training.config import base_config, loop_aware_fine_tune, objective_settings


def apply(c: ConfigDict, *, learning_rate: float, loop: bool,
          loop_learning_rate: float) -> ConfigDict:
  c.data.batch_size = 4
  c.data.seq_len = 1024
  c.data.options = ConfigDict(dict(pack=True, num_packing_bins=32))
  c.num_steps = 2_400
  c.log_every_steps = 10
  c.optim.learning_rate = learning_rate
  c.optim.warmup_steps = 100
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 2
  c.eval.every_steps = 200
  c.eval.num_prompts = 3
  c.eval.patience = 4
  if loop:
    loop_aware_fine_tune(c, num_steps=300, learning_rate=loop_learning_rate, warmup_steps=10)
    c.eval.every_steps = 100
    c.eval.patience = 0
  return c


def head_drafter(recipe: str, *, kind: str, **heads) -> ConfigDict:
  """The block drafter's `cpu10k` recipe with the heads of `kind` ("dspark", "domino")."""
  if recipe not in ("cpu10k", "cpu10k_loop"):
    raise ValueError(f"Unknown recipe {recipe!r}; use 'cpu10k' or 'cpu10k_loop'.")
  c = base_config()
  c.target.model = "smollm2-135m-instruct"
  c.target.dtype = "float32"
  c.drafter = ConfigDict(dict(kind=kind, block_size=4, num_layers=2, draft_vocab_size=0,
                              mask_token_id=16, **heads))
  c.objective = kind
  # DSpark reads the target's distribution with its own terms: of the
  # distillation keys only feature_noise applies to it.
  c.objective_cfg = objective_settings(anchors_per_sequence=64, distillation=kind != "dspark")
  c.data.source = "path"
  c.data.path = ""
  c.optim.grad_clip_norm = 1.0
  return apply(c, learning_rate=1e-3, loop=recipe == "cpu10k_loop", loop_learning_rate=3e-4)
