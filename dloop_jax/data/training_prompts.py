"""The prompts a `target_responses` build answers: selected from ShareGPT, encoded to ids.

ShareGPT first user messages are visited in a seeded order and filtered
(`select_sharegpt_prompts`); each is encoded with the target's chat template,
or, for targets without a tokenizer (tiny random ones), as bytes
(`ByteTokenizer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
  """A prompt to answer: its key (ShareGPT conversation id, or "random/<i>") and token ids."""

  key: str
  ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShareGPTRecord:
  """A ShareGPT conversation's first user message, as prompt selection reads it."""

  key: str  # conversation id
  text: str  # first user message
  starts_with_user: bool



def prompt_text_key(text: str) -> str:
  """What makes two prompts the same: the text, case-folded, whitespace collapsed."""
  return " ".join(text.casefold().split())


class ByteTokenizer:
  """Text -> ids for targets without a tokenizer: UTF-8 bytes modulo the vocab.

  Lets tiny random targets answer real ShareGPT prompts (tests, CI); the
  "chat template" is a plain `User: ...\\nAssistant:` wrapper.
  """

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size
    self.stop_token_ids: tuple[int, ...] = ()

  def encode(self, text: str) -> list[int]:
    return [b % self.vocab_size for b in text.encode("utf-8")]

  def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return self.encode(text + "Assistant:")


def encode_prompt(text: str, *, tokenizer: Any, chat_template: bool,
                  system_prompt: str = "") -> list[int]:
  """A user message -> prompt token ids (chat-formatted, generation prompt added)."""
  messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
  messages.append({"role": "user", "content": text})
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.chat(messages) if chat_template else tokenizer.encode(text)
  if chat_template:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
  return list(tokenizer.encode(text))



def select_sharegpt_prompts(
    records: Sequence[ShareGPTRecord],
    *,
    heldout_texts: Iterable[str],
    num_prompts: int,
    seed: int,
    skip_continuations: bool,
    max_tokens: int,
    encode: Callable[[str], list[int]],
) -> tuple[list[Prompt], dict[str, int]]:
  """Up to `num_prompts` training prompts of `records` (train split, file order).

  Records are visited in a seeded random order. Skipped, and counted:
  continuation parts (with `skip_continuations`), a text equal to a held-out
  prompt (ShareGPT reposts messages under other ids, and the split hashes
  ids: such a prompt would leak into the benchmark's held-out chat set), a
  repeat of a text already taken, and prompts over `max_tokens` once encoded.
  Texts compare by `prompt_text_key`.

  Returns:
    (prompts, counts).
  """
  heldout = {prompt_text_key(t) for t in heldout_texts}
  counts = {"examined": 0, "continuation": 0, "heldout_duplicate": 0, "duplicate": 0,
            "overlong_tokens": 0}
  seen: set[str] = set()
  out = []
  for j in np.random.default_rng(seed).permutation(len(records)):
    if len(out) >= num_prompts:
      break
    record = records[j]
    counts["examined"] += 1
    if skip_continuations and not record.starts_with_user:
      counts["continuation"] += 1
      continue
    text_key = prompt_text_key(record.text)
    if text_key in heldout:
      counts["heldout_duplicate"] += 1
      continue
    if text_key in seen:
      counts["duplicate"] += 1
      continue
    seen.add(text_key)
    ids = encode(record.text)
    if len(ids) > max_tokens:
      counts["overlong_tokens"] += 1
      continue
    out.append(Prompt(key=record.key, ids=tuple(int(t) for t in ids)))
  return out, counts


def prompts_digest(prompts: Sequence[Prompt]) -> str:
  """Identifies a list of prompts (keys and ids, in order)."""
  return hashlib.sha256(json.dumps([[p.key, p.ids] for p in prompts]).encode()).hexdigest()


def by_length(prompts: Sequence[Prompt]) -> list[Prompt]:
  """Sorted by length: rows of a batch pad to similar widths, and the few
  prompt-width buckets compile once each."""
  return sorted(prompts, key=lambda p: (len(p.ids), p.key))
