"""Greedy generation with the real default model (SmolLM2-135M-Instruct GGUF).

(a) Our jit `generate(mode="ar")` continues chat prompts exactly like
    transformers' PyTorch `generate(do_sample=False)` on the same weights.
    The prompts run as one batch of rows of different lengths, transformers
    runs each alone: padding changes no row.
(b) Logit parity of our forward (prefill, then a second call against the
    cache) with transformers' own GGUF loading: max |diff| <= 2e-3.

Near-tie rule (docs/design.md §The near-tie rule): sequences are identical, or at their first
difference the top-2 logit gap of the model that produced the expected sequence
is below 1e-3; after such a flip the rest need not match.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import model_fixtures
from dloop_jax.decoding import generate
from lossless import assert_same_or_near_tie

pytestmark = pytest.mark.real_model

MAX_NEW = 24

CHATS = [
    [{"role": "user", "content": "Explain photosynthesis to a ten year old in a few sentences."}],
    [{"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "user", "content": "List three prime numbers greater than 50."}],
    [{"role": "system", "content": "You are a careful Python programmer."},
     {"role": "user", "content": "Write a function that reverses a string, with a docstring."}],
    [{"role": "user", "content": "Give me a name for a cat."},
     {"role": "assistant", "content": "How about Biscuit?"},
     {"role": "user", "content": "Why that one? Answer in two sentences."}],
]


@pytest.fixture(scope="module")
def real():
  """(our LoadedTarget, transformers' model from the same GGUF), loaded once per process."""
  return model_fixtures.real_pair()


def _cut_at_stop(row: list[int], stop: list[int]) -> list[int]:
  """Tokens up to and including the first stop token."""
  return next((row[:i + 1] for i, t in enumerate(row) if t in stop), row)


def _transformers_greedy(reference, prompts: list[list[int]], max_new_tokens: int,
                         stop: list[int]) -> list[list[int]]:
  """New tokens of transformers' greedy `generate()`, one prompt at a time (no padding)."""
  rows = []
  with torch.no_grad():
    for p in prompts:
      ids = torch.tensor([p])
      out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens, eos_token_id=stop,
                               pad_token_id=stop[0])
      rows.append(_cut_at_stop(out[0, len(p):].tolist(), stop))
  return rows


def test_greedy_matches_transformers(real):
  """24 greedy tokens on 5 chat prompts, one batch, equal transformers' greedy generate()."""
  target, reference = real
  tok = target.tokenizer
  stop = list(tok.stop_token_ids)
  prompts = [tok.apply_chat_template(chat) for chat in CHATS]
  lengths = [len(p) for p in prompts]
  assert max(lengths) - min(lengths) >= 25, lengths  # most rows padded
  ours = generate(target.model, prompts, max_new_tokens=MAX_NEW, mode="ar", stop_tokens=stop)
  theirs = _transformers_greedy(reference, prompts, MAX_NEW, stop)
  for prompt, want, got in zip(prompts, theirs, ours.tokens):
    assert len(got) == MAX_NEW or got[-1] in stop
    assert_same_or_near_tie(reference, prompt, want, got)
  # The comparison has substance: long answers, and one that ends on a stop token.
  assert sum(len(t) for t in theirs) >= 3 * MAX_NEW
  assert any(len(t) < MAX_NEW and t[-1] in stop for t in theirs)


# ------------------------------------------- logits parity (same loaded pair)
# Max |logit diff| allowed against transformers on the real model's weights.
REAL_TOL = 2e-3
REAL_PROMPTS = [
    [{"role": "user", "content": "Explain in two short paragraphs why the sky looks blue during"
                                 " the day and red at sunset, with one concrete example."}],
    [{"role": "system", "content": "You are a careful Python programmer."},
     {"role": "user", "content": "Write a function `primes(n: int) -> list[int]` that returns"
                                 " all primes below n using a sieve, and explain its cost."}],
]


def test_real_gguf_parity(real):
  target, reference = real
  prompts = [target.tokenizer.apply_chat_template(m) for m in REAL_PROMPTS]
  length = min(len(p) for p in prompts)
  assert length >= 40
  tokens = np.asarray([p[:length] for p in prompts], np.int32)
  expected = model_fixtures.torch_logits(reference, tokens)
  got = model_fixtures.flax_logits(target.model, tokens, split=length - 9, compiled=False)
  diff = float(np.max(np.abs(got - expected)))
  print(f"real GGUF max |logit diff| = {diff:.2e} over {tokens.shape}")
  assert diff <= REAL_TOL
  # Same greedy next token everywhere except at near-ties.
  agree = (got.argmax(-1) == expected.argmax(-1)).mean()
  assert agree > 0.97


def test_real_gguf_config(real):
  target, reference = real
  c, hf = target.config, reference.config
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
      hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
      hf.intermediate_size)
  assert c.vocab_size == hf.vocab_size == 49152
  assert c.tie_embeddings and c.rope_theta == 100000.0
  assert target.tokenizer.eos_token_id in c.eos_token_ids
