"""Drafter training data for SmolLM2-135M-Instruct (the default target).

    python -m train.data --config configs/data_smollm2.py            # 4,000 prompts
    python -m train.data --config configs/data_smollm2.py:small      # 256 prompts, a first look

ShareGPT first user messages (train split; the held-out 2 % is never used),
formatted with the model's chat template and answered greedily by the target,
with its hidden states at EAGLE-3's low / middle / high layers (1, 14, 26).
Block drafters that read more layers set e.g.
`--config.target_responses.taps="(1,5,10,14,18,22,26)"`.
"""

from ml_collections import ConfigDict

from dloop_jax.models.config import default_taps


def get_config(recipe: str = "") -> ConfigDict:
  c = ConfigDict()
  c.data_dir = ""  # "" = $DLOOP_DATA_DIR, else ~/.cache/dloop_jax/datasets
  c.datasets = ["sharegpt", "target_responses"]
  c.keep_work_dir = False  # keep the resumable chunks after a finished build
  c.progress = True
  c.sharegpt = ConfigDict(dict(
      heldout_fraction=0.02,
      max_prompt_chars=8192,
      max_conversations=0,  # 0 = the whole corpus
  ))
  c.target_responses = ConfigDict(dict(
      name="",  # "" = derived from the settings
      target="smollm2-135m-instruct",
      target_seed=0,  # tiny targets only
      target_init_std=0.3,  # tiny targets only
      taps=tuple(default_taps(30)),
      prompt_source="sharegpt",
      num_prompts=4000,
      max_new_tokens=512,
      temperature=0.0,
      top_k=0,
      top_p=1.0,
      seed=0,
      chat_template=True,
      system_prompt="",  # "" = the chat template's default system message
      max_prompt_tokens=1024,
      skip_continuations=True,
      # Batch 8: about 4x the tokens/s of batch 1 on a CPU (docs/data.md).
      batch_size=8,
      chunk_size=64,
      random_prompt_min_len=4,
      random_prompt_max_len=16,
  ))
  if recipe == "small":
    c.target_responses.num_prompts = 256
    c.target_responses.max_new_tokens = 256
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '' or 'small'.")
  return c
