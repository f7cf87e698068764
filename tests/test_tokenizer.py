"""The GGUF-built tokenizer encodes exactly like transformers' own GGUF tokenizer."""

from __future__ import annotations

import os

import numpy as np
import pytest
import transformers

import model_fixtures
from dloop_jax.models.registry import registry_path
from dloop_jax.models.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

_FIXED = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "Hello world", "Hello  world ",
    "  leading and trailing  ", "ALL CAPS and MiXeD cAsE", "don't won't it's we'll they're I'd",
    "1", "12", "123", "1234567890", " 3.14159 ", "-42 +7 1e-9 0x1F 1,000,000", "2026-12-02T11:28:13Z",
    "naïve café résumé façade", "Ünïcödé ßtraße", "日本語のテキスト", "中文分词测试", "한국어 문장",
    "Русский текст", "العربية", "עברית", "ελληνικά", "हिन्दी", "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦", "∑∫√∞≠≤≥",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "<html><body class=\"x\">hi</body></html>", "SELECT * FROM t WHERE id = 3;", "$ ls -la | grep .py",
    "https://example.com/path?q=1&r=two#frag", "user@example.com", "C:\\Users\\name\\file.txt",
    "{\"key\": [1, 2, {\"nested\": null}]}", "````markdown\n# Title\n- item\n````", "\u00a0nbsp\u2009thin\u200bzw",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "text<|im_end|>more", "<|im_start|>", "<|im_start",
    "a" * 300, "ab" * 100, " " * 50, "\r\n windows\r\n", "tab\tseparated\tvalues", "......!!!???",
]

_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \n\t.,;:!?'\"()[]{}<>/\\|@#$%^&*-+=_~`")
    + ["é", "ñ", "ü", "ß", "中", "文", "日", "本", "😀", "🎉", "∑", "—", "…", "\u00a0", "'s", " the",
       "ing", "tion", "<|im_end|>", "<|im_start|>", "  ", "\n\n", "123", "def ", "return "]
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon"},
     {"role": "user", "content": "Another, about 日本 and 😀."}],
]


def _strings() -> list[str]:
  rng = np.random.default_rng(0)
  random = ["".join(rng.choice(_POOL, size=int(rng.integers(1, 40)))) for _ in range(300)]
  return _FIXED + random


@pytest.fixture(scope="module")
def pair() -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
  path = registry_path("smollm2-135m-instruct")
  folder, name = os.path.split(path)
  with model_fixtures.fast_gguf_reads():
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return Tokenizer.from_gguf(path), reference


def test_encode_matches_transformers_gguf_tokenizer(pair):
  ours, reference = pair
  strings = _strings()
  assert len(strings) > 300
  for text in strings:
    for special in (True, False):
      assert ours.encode(text, add_special_tokens=special) == reference.encode(
          text, add_special_tokens=special), repr(text)


def test_decode_matches(pair):
  ours, reference = pair
  for text in _strings():
    ids = reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids), repr(text)
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_chat_template_matches(pair):
  ours, reference = pair
  for messages in CONVERSATIONS:
    for prompt in (True, False):
      text = ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
      assert text == reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
      ids = ours.apply_chat_template(messages, add_generation_prompt=prompt)
      assert ids == reference.apply_chat_template(
          messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)
      # Encoding the formatted text gives the same ids: special tokens stay whole.
      assert ids == ours.encode(text)
  text = ours.apply_chat_template(CONVERSATIONS[0], tokenize=False)
  assert text.endswith("<|im_start|>assistant\n")


def test_special_ids(pair):
  ours, reference = pair
  assert ours.vocab_size == len(reference) == 49152
  assert ours.eos_token_id == reference.eos_token_id == 2  # <|im_end|>
  assert ours.bos_token_id == reference.bos_token_id
  assert ours.stop_token_ids[0] == ours.eos_token_id
  assert ours.pad_token_id == 2
  assert ours.decode([ours.eos_token_id]) == "<|im_end|>"


def test_hf_dir_round_trip(pair, tmp_path):
  ours, _ = pair
  ours.hf.save_pretrained(tmp_path)
  reloaded = Tokenizer.from_hf_dir(tmp_path, extra_stop_token_ids=[0])
  assert reloaded.stop_token_ids == (2, 0)
  for text in _strings()[:120]:
    assert reloaded.encode(text) == ours.encode(text), repr(text)
  assert reloaded.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
