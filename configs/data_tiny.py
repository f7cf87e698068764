"""Drafter training data from the tiny random target (tests, CI, tiny configs).

    python -m train.data --config configs/data_tiny.py --data_dir /tmp/dloop_data
    python -m train.data --config configs/data_tiny.py:sharegpt --data_dir /tmp/dloop_data

Default: random token-id prompts (4-16 tokens) with 48-token responses, so
every example fits `seq_len` 64 of configs/tiny_*.py. The target is
`tiny_target(seed=1)`, the one those configs train for. `sharegpt`: 16
ShareGPT prompts (of the first 400 conversations) encoded as bytes, as in CI.
"""

from ml_collections import ConfigDict

from dloop_jax.models.config import default_taps


def get_config(recipe: str = "") -> ConfigDict:
  c = ConfigDict()
  c.data_dir = ""
  c.datasets = ["target_responses"]
  c.keep_work_dir = False
  c.progress = True
  c.responses_dir = ""  # where answers are kept without features (see data_smollm2.py)
  c.sharegpt = ConfigDict(dict(heldout_fraction=0.02, max_prompt_chars=8192, max_conversations=0))
  c.target_responses = ConfigDict(dict(
      name="",
      target="tiny",
      target_seed=1,
      target_init_std=0.3,
      taps=tuple(default_taps(2)),
      prompt_source="random",
      num_prompts=256,
      max_new_tokens=48,
      temperature=0.0,
      top_k=0,
      top_p=1.0,
      seed=0,
      chat_template=True,
      system_prompt="",
      max_prompt_tokens=96,
      skip_continuations=True,
      batch_size=16,
      chunk_size=64,
      random_prompt_min_len=4,
      random_prompt_max_len=16,
      # The target's k most likely next tokens and their probabilities at every
      # position (DSpark's distillation targets); 0 = none.
      target_topk=0,
  ))
  if recipe == "sharegpt":
    c.datasets = ["sharegpt", "target_responses"]
    c.sharegpt.max_conversations = 400
    c.target_responses.prompt_source = "sharegpt"
    c.target_responses.num_prompts = 16
    c.target_responses.max_new_tokens = 24
    c.target_responses.batch_size = 4
    c.target_responses.chunk_size = 8
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '' or 'sharegpt'.")
  return c
