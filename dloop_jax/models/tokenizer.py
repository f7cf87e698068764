"""Tokenizer: a thin wrapper over a transformers fast tokenizer.

From a Hugging Face directory the tokenizer is `AutoTokenizer.from_pretrained`.
From a GGUF file it is rebuilt from the file's vocabulary, merges, token types,
pre-tokenizer name and chat template with transformers' own GGUF conversion
(`transformers.integrations.gguf`), so it encodes exactly as
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` does, but without that
call's second full read of the file, which is most of its time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from dloop_jax.errors import ConfigError, ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
  """Whether a checkpoint directory carries a tokenizer."""
  return any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES)


class Tokenizer:
  """Text <-> token ids, chat templates and stop tokens for one target model."""

  def __init__(self, hf_tokenizer: Any, *, extra_stop_token_ids: Sequence[int] = (),
               source: str = ""):
    """Wraps a transformers tokenizer.

    Args:
      hf_tokenizer: a transformers (fast) tokenizer.
      extra_stop_token_ids: stop ids besides the tokenizer's eos (e.g. the
        model config's or generation config's eos list).
      source: where it was loaded from, for messages.
    """
    self.hf = hf_tokenizer
    self.source = source
    stops = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
    stops += [int(t) for t in extra_stop_token_ids if int(t) not in stops]
    self._stop_token_ids = tuple(stops)

  # ---------------------------------------------------------------- loading
  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike, *,
                  extra_stop_token_ids: Sequence[int] = ()) -> "Tokenizer":
    """`AutoTokenizer.from_pretrained(path)`; raises `ModelLoadError` if it cannot."""
    import transformers  # local: slow to import, not needed by the model code

    path = os.fspath(path)
    if not has_tokenizer_files(path):
      raise ModelLoadError(
          f"{path!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}). Save one with"
          " `tokenizer.save_pretrained(dir)`.")
    try:
      hf = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError / ValueError / ... here
      raise ModelLoadError(
          f"Could not load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e
    return cls(hf, extra_stop_token_ids=extra_stop_token_ids, source=path)

  @classmethod
  def from_gguf(cls, path: str | os.PathLike, *, reader: Any = None,
                extra_stop_token_ids: Sequence[int] = ()) -> "Tokenizer":
    """Builds the tokenizer a GGUF file describes (vocabulary, merges, chat template).

    Args:
      path: the .gguf file.
      reader: the file already opened with `gguf_loader.open_gguf` (saves
        parsing it twice).
      extra_stop_token_ids: see `__init__`.
    """
    import transformers  # local: slow to import, not needed by the model code
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from dloop_jax.models.gguf_loader import open_gguf

    path = os.fspath(path)
    reader = reader if reader is not None else open_gguf(path)
    architecture, tokenizer_dict, tokenizer_config = gguf_tokenizer_metadata(reader)
    if "tokens" not in tokenizer_dict:
      raise ModelLoadError(f"GGUF {path!r} has no tokenizer.ggml.tokens; it carries no tokenizer.")
    try:
      backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:  # ValueError for unknown types, KeyError for missing fields
      raise ModelLoadError(
          f"Cannot build the tokenizer of GGUF {path!r} ({type(e).__name__}: {e}); its tokenizer"
          " metadata is incomplete or of an unsupported kind.") from e
    # The keyword arguments `AutoTokenizer.from_pretrained(..., gguf_file=)`
    # passes too: special tokens by string, add_bos/add_eos flags, chat template.
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, **{**tokenizer_config, **extra_kwargs})
    return cls(hf, extra_stop_token_ids=extra_stop_token_ids, source=path)

  # ---------------------------------------------------------------- use
  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return len(self.hf)

  @property
  def bos_token_id(self) -> int | None:
    return self.hf.bos_token_id

  @property
  def eos_token_id(self) -> int | None:
    return self.hf.eos_token_id

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """Ids that end a generation: the tokenizer's eos, then the extra ones."""
    return self._stop_token_ids

  eos_token_ids = stop_token_ids

  @property
  def pad_token_id(self) -> int:
    """The pad id, falling back to eos, then 0 (padding is masked anyway)."""
    for token_id in (self.hf.pad_token_id, self.hf.eos_token_id):
      if token_id is not None:
        return int(token_id)
    return 0

  @property
  def has_chat_template(self) -> bool:
    return bool(getattr(self.hf, "chat_template", None))

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (`add_special_tokens` adds BOS where the model wants one)."""
    return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True,
                          tokenize: bool = True) -> list[int] | str:
    """Formats a conversation with the model's chat template.

    Args:
      messages: `[{"role": "user", "content": "..."}, ...]`.
      add_generation_prompt: end with the assistant turn's opening.
      tokenize: return token ids (the default) or the formatted text.

    Returns:
      Token ids, or the text when `tokenize=False`.
    """
    if not self.has_chat_template:
      raise ConfigError(
          f"The tokenizer from {self.source or 'this model'} has no chat template; encode plain"
          " text instead, or load an instruct model.")
    out = self.hf.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        tokenize=tokenize, return_dict=False)
    return out if isinstance(out, str) else [int(i) for i in out]

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab={self.vocab_size}, stops={self.stop_token_ids},"
            f" source={self.source!r})")


def gguf_tokenizer_metadata(reader: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
  """`(architecture, tokenizer_dict, tokenizer_config)` from an open GGUF file.

  The same triple as transformers' `get_gguf_tokenizer`, read with the `gguf`
  package: transformers' own GGUF reader imports torch, which the library
  does not otherwise need.
  """
  from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

  def value(key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
      return None
    try:
      return field.contents()
    except Exception as e:
      raise ModelLoadError(
          f"GGUF metadata field {key!r} is corrupt ({type(e).__name__}: {e}).") from e

  groups = {}
  for group, renames in GGUF_TOKENIZER_MAPPING.items():
    groups[group] = {}
    for key, name in renames.items():
      found = value(f"tokenizer.{key}")
      if found is not None:
        groups[group][name] = found
  tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
  tokenizer_type = tokenizer_dict.get("tokenizer_type")
  # As transformers does: llama.cpp adds BOS to a sentencepiece vocabulary
  # that does not say otherwise; Gemma 4's chat template writes BOS itself.
  if tokenizer_type == "llama":
    tokenizer_config.setdefault("add_bos_token", True)
  elif tokenizer_type == "gemma4":
    tokenizer_config["add_bos_token"] = False
  tokens = tokenizer_dict.get("tokens") or []
  for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    token_id = value(f"tokenizer.ggml.{key}")
    tokenizer_config[special] = (tokens[int(token_id)] if token_id is not None
                                 and 0 <= int(token_id) < len(tokens) else None)
  return str(value("general.architecture")), tokenizer_dict, tokenizer_config
