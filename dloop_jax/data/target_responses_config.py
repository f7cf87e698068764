"""What a `target_responses` build generates: its config, named by a hash of its fields.

Every field of `TargetResponsesConfig` changes the data, so every field is
in the derived name (`make_config`): two builds that would differ never share
a directory. The builder is `target_responses.TargetResponses`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import tensorflow_datasets as tfds

from dloop_jax.errors import ConfigError
from dloop_jax.plain_values import to_plain

NAME = "target_responses"
TRAIN = "train"
PROMPT_SOURCES = ("sharegpt", "random")
WORK_DIR_NAME = "target_responses_work"
# The optional features of an example with `target_topk` > 0.
TOPK_KEYS = ("target_topk_ids", "target_topk_probs")


@dataclasses.dataclass(eq=False)
class TargetResponsesConfig(tfds.core.BuilderConfig):
  """What is generated (every field changes the data, so all are in the name).

  Attributes:
    target: "tiny" (a random `tiny_target`), anything `load_target` takes (a
      registry name such as "smollm2-135m-instruct", a .gguf, an HF dir), or,
      when the builder is given a model, that model's name.
    target_seed: tiny only: `tiny_target(seed=...)`.
    target_init_std: tiny only.
    taps: tapped decoder layers (() = `default_taps(num_layers)`).
    prompt_source: "sharegpt" (train split first user messages) or "random"
      (random token ids; tiny targets, CI).
    num_prompts: prompts to answer (fewer if the source has fewer).
    max_new_tokens: response length limit.
    temperature: 0 = greedy.
    top_k: 0 = no limit.
    top_p: 1 = no limit.
    seed: prompt selection and sampling.
    chat_template: format ShareGPT prompts with the tokenizer's chat template
      (else plain text). Targets without a tokenizer encode text as bytes.
    system_prompt: optional system message ("" = the template's default).
    max_prompt_tokens: drop prompts that encode to more tokens.
    skip_continuations: drop ShareGPT parts that start with an assistant turn.
    batch_size: rows per `generate()` call.
    chunk_size: prompts per resumable work chunk (a multiple of batch_size).
    random_prompt_min_len / random_prompt_max_len: random prompt lengths.
    target_topk: also store the target's k most likely next tokens and their
      probabilities at every position (0 = none). Needs the full forward over
      each finished answer (answers are generated without capture).
    sharegpt_heldout_fraction / sharegpt_max_prompt_chars /
      sharegpt_max_conversations: the `sharegpt` config the prompts come from
      (max_conversations > 0 reads only the first N conversations; tests).
  """

  target: str = "smollm2-135m-instruct"
  target_seed: int = 0
  target_init_std: float = 0.3
  taps: tuple[int, ...] = ()
  prompt_source: str = "sharegpt"
  num_prompts: int = 1000
  max_new_tokens: int = 512
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  chat_template: bool = True
  system_prompt: str = ""
  max_prompt_tokens: int = 1024
  skip_continuations: bool = True
  batch_size: int = 8
  chunk_size: int = 64
  random_prompt_min_len: int = 4
  random_prompt_max_len: int = 16
  target_topk: int = 0
  sharegpt_heldout_fraction: float = 0.02
  sharegpt_max_prompt_chars: int = 8192
  sharegpt_max_conversations: int = 0

  def sharegpt_options(self) -> dict[str, Any]:
    return {"heldout_fraction": self.sharegpt_heldout_fraction,
            "max_prompt_chars": self.sharegpt_max_prompt_chars,
            "max_conversations": self.sharegpt_max_conversations}

  def spec(self) -> dict[str, Any]:
    """The fields that decide the data (everything but TFDS bookkeeping)."""
    base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
    out = {}
    for f in dataclasses.fields(self):
      if f.name not in base:
        value = getattr(self, f.name)
        if f.name in _NEWER_FIELDS and value == f.default:
          continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# Fields added after builds were named: left out of `spec()` (and so of the
# derived name) at their default, so that those builds keep their names.
_NEWER_FIELDS = ("target_topk",)
_TFDS_FIELDS = frozenset(f.name for f in dataclasses.fields(tfds.core.BuilderConfig))
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TargetResponsesConfig)
                      if f.name not in _TFDS_FIELDS)




def target_slug(text: str) -> str:
  """A short, file-name-safe form of a target spec (a registry name, a file or directory)."""
  base = text
  if os.sep in text or text.endswith(".gguf"):  # a file or directory: its name
    base = os.path.splitext(os.path.basename(os.path.normpath(text)))[0]
  slug = "".join(ch if ch.isalnum() else "_" for ch in base.lower()).strip("_")
  return slug[:40] or "target"


def make_config(*, name: str | None = None, **fields) -> TargetResponsesConfig:
  """A config whose name is derived from its fields unless given.

  The derived name is `<target slug>_<sha256 of the fields, 10 hex>`, so two
  configs that would produce different data never share a directory.
  """
  unknown = sorted(set(fields) - set(CONFIG_FIELDS))
  if unknown:
    raise ConfigError(f"Unknown target_responses options {unknown}; known: {list(CONFIG_FIELDS)}.")
  if "taps" in fields:
    fields["taps"] = tuple(int(t) for t in fields["taps"])
  config = TargetResponsesConfig(name="_", **fields)
  _validate(config)
  if name is None:
    digest = hashlib.sha256(json.dumps(config.spec(), sort_keys=True).encode()).hexdigest()
    name = f"{target_slug(config.target)}_{digest[:10]}"
  return dataclasses.replace(config, name=name)


def config_from_data_config(config: Any) -> TargetResponsesConfig:
  """The config a data config (configs/data_*.py) describes: its `target_responses`
  fields and its `sharegpt` options; the name derived unless set."""
  fields = to_plain(config.target_responses)
  name = fields.pop("name", "") or None
  for key, value in to_plain(config.sharegpt).items():
    if key != "source_path":
      fields[f"sharegpt_{key}"] = value
  return make_config(name=name, **fields)




def snapshot_config(config: TargetResponsesConfig) -> TargetResponsesConfig:
  """The config of a snapshot of `config`'s build: same settings, name + "_snapshot"."""
  return dataclasses.replace(config, name=f"{config.name}_snapshot")


def _validate(c: TargetResponsesConfig) -> None:
  if c.prompt_source not in PROMPT_SOURCES:
    raise ConfigError(f"prompt_source must be one of {PROMPT_SOURCES}, got {c.prompt_source!r}.")
  for key in ("num_prompts", "max_new_tokens", "batch_size", "chunk_size", "max_prompt_tokens",
              "random_prompt_min_len", "random_prompt_max_len"):
    value = getattr(c, key)
    if not isinstance(value, int) or value < 1:
      raise ConfigError(f"target_responses {key} must be an int >= 1, got {value!r}.")
  if not isinstance(c.target_topk, int) or c.target_topk < 0:
    raise ConfigError(f"target_responses target_topk must be an int >= 0, got {c.target_topk!r}.")
  if c.chunk_size % c.batch_size:
    raise ConfigError(f"chunk_size ({c.chunk_size}) must be a multiple of batch_size"
                      f" ({c.batch_size}).")
  if c.random_prompt_min_len > c.random_prompt_max_len:
    raise ConfigError("random_prompt_min_len must be <= random_prompt_max_len.")

