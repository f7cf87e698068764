"""Prompt lookup: drafts copied from earlier in a row's own committed tokens.

Where a passage repeats (code that reuses names, an answer quoting its
question), the tokens that followed the last earlier occurrence of the row's
newest n tokens are a draft that costs no forward:

    committed:  ... a b c X Y Z W ... a b c        (the last token is the anchor)
                          ^^^^^^^                  proposal: X Y Z W

The engine's lookup stage (`generate(lookup="prompt")`) runs the drafter's
first stage as usual and, per row, replaces its drafts by the proposal when
the lookup matched at least `min_match` tokens and the drafter's first draft
has probability below `max_probability` (a rule fixed before measuring:
docs/drafters.md, draft sources that need no training). Such a row drafts no
further stage (they would continue the drafter's own drafts, not the
proposal) and verifies the proposal instead, up to the round's whole draft
width: gamma tokens in sd, S_max * gamma in dloop, so that at a fixed width
(2 stages of 2 at W = 5) a lookup round verifies as many drafts in either
mode. Verification is unchanged, so greedy outputs stay `ar`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dloop_jax.decoding import arguments
from dloop_jax.errors import ConfigError

LOOKUPS = ("off", "prompt")
# "auto": "prompt" where the lookup stage applies (greedy chains
# of sd / dloop), "off" elsewhere.
CHOICES = ("auto",) + LOOKUPS
# The longest suffix searched; shorter ones down to the minimum match follow.
MAX_NGRAM = 3


@struct.dataclass
class Proposal:
  """One lookup per row.

  Attributes:
    tokens: [B, block_size] the proposed drafts (entries from `num_tokens` on are
      padding).
    num_tokens: [B] int32 proposed tokens, 0 without a match; fewer than block_size
      where the occurrence ends near the newest token (only committed tokens
      are proposed).
    match: [B] int32 length of the matched suffix, 0 without a match.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  match: jax.Array


def propose(*, history: jax.Array, lengths: jax.Array, block_size: int,
            min_match: int) -> Proposal:
  """The lookup's drafts after each row's committed tokens.

  For n = `MAX_NGRAM` down to `min_match`, the newest earlier occurrence of
  the row's last n tokens (one that ends before the last token); the longest
  n that occurs wins. All windows are compared at once: no loop over
  positions.

  Args:
    history: [B, T] committed tokens of each row (prompt, then generated);
      entries at or past `lengths[b]` are ignored.
    lengths: [B] int32 committed tokens per row.
    block_size: the drafts proposed at most (the round's draft width).
    min_match: the shortest suffix searched (1 .. `MAX_NGRAM`).

  Returns:
    A `Proposal`.
  """
  b, t = history.shape
  lengths = lengths.astype(jnp.int32)
  best_start = jnp.full((b,), -1, jnp.int32)  # where the proposal starts; -1 none
  match = jnp.zeros((b,), jnp.int32)
  for n in range(MAX_NGRAM, min_match - 1, -1):
    if n >= t:
      continue
    suffix_at = jnp.maximum(lengths[:, None] - n + jnp.arange(n)[None, :], 0)
    suffix = jnp.take_along_axis(history, suffix_at, axis=1)  # [B, n]
    # windows j = 0 .. t - n: history[:, j : j + n] == suffix
    same = jnp.ones((b, t - n + 1), bool)
    for i in range(n):
      same &= history[:, i:t - n + 1 + i] == suffix[:, i:i + 1]
    j = jnp.arange(t - n + 1)[None, :]
    # An earlier occurrence ends before the newest token, so that at least
    # one committed token follows it.
    same &= j + n <= lengths[:, None] - 1
    newest = jnp.max(jnp.where(same, j, -1), axis=1)
    take = (newest >= 0) & (best_start < 0)  # a longer match found earlier wins
    best_start = jnp.where(take, newest + n, best_start)
    match = jnp.where(take, n, match)
  found = best_start >= 0
  at = jnp.clip(best_start[:, None] + jnp.arange(block_size)[None, :], 0, t - 1)
  tokens = jnp.take_along_axis(history, at, axis=1)
  num_tokens = jnp.where(found, jnp.clip(lengths - best_start, 0, block_size), 0)
  return Proposal(tokens=tokens.astype(jnp.int32), num_tokens=num_tokens.astype(jnp.int32),
                  match=match)


def committed_history(*, prompts: jax.Array, prompt_lengths: jax.Array, out: jax.Array,
                      num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's committed tokens as one contiguous buffer.

  Args:
    prompts: [B, Tp] prompts, padded after `prompt_lengths`.
    prompt_lengths: [B].
    out: [B, N] generated tokens, valid before `num_new`.
    num_new: [B].

  Returns:
    (history [B, Tp + N], lengths [B] = prompt_lengths + num_new).
  """
  tp, n = prompts.shape[1], out.shape[1]
  t = jnp.arange(tp + n)[None, :]
  from_prompt = jnp.pad(prompts.astype(jnp.int32), ((0, 0), (0, n)))
  from_out = jnp.take_along_axis(out, jnp.clip(t - prompt_lengths[:, None], 0, n - 1), axis=1)
  history = jnp.where(t < prompt_lengths[:, None], from_prompt, from_out)
  return history, (prompt_lengths + num_new).astype(jnp.int32)


def fires(*, proposal: Proposal, first_logprob: jax.Array, drafting: jax.Array,
          min_match: int, max_probability: float) -> jax.Array:
  """[B] bool: the rows whose first stage takes the lookup's drafts instead of the drafter's.

  Args:
    proposal: this round's lookup.
    first_logprob: [B] the drafter's log-probability of its first draft
      (greedy: its top probability).
    drafting: [B] bool, rows that draft this round.
  """
  p1 = jnp.exp(first_logprob.astype(jnp.float32))
  return drafting & (proposal.match >= min_match) & (p1 < max_probability)


def resolve(lookup: str, *, mode: str, greedy: bool, tree_budget: int) -> str:
  """"auto" -> "prompt" for greedy chains of sd / dloop, else "off"; others as given."""
  if lookup != "auto":
    return lookup
  return "prompt" if (mode != "ar" and greedy and not tree_budget) else "off"


def validate(*, lookup, min_match, max_probability, mode: str, greedy: bool,
             tree_budget: int) -> None:
  """Raises ConfigError for lookup options `generate()` cannot run."""
  if lookup not in CHOICES:
    raise ConfigError(f"lookup must be one of {CHOICES}, got {lookup!r}.")
  if not (arguments.is_int(min_match) and 1 <= min_match <= MAX_NGRAM):
    raise ConfigError(f"lookup_min_match must be an int in 1..{MAX_NGRAM}, got {min_match!r}.")
  if (isinstance(max_probability, bool) or not isinstance(max_probability, (int, float))
      or not 0.0 <= max_probability <= 1.0):
    raise ConfigError(f"lookup_max_probability must be a number in [0, 1], got"
                      f" {max_probability!r}.")
  if lookup != "prompt":
    return
  if mode == "ar":
    raise ConfigError("lookup='prompt' extends a drafter's first stage: it needs mode 'sd' or"
                      " 'dloop' (and a drafter).")
  if not greedy:
    raise ConfigError("lookup='prompt' is not supported with sampling yet (rejection sampling"
                      " would need the draft distribution of a point-mass proposal): decode"
                      " greedily (temperature 0) or use lookup='off'.")
  if tree_budget:
    raise ConfigError("lookup='prompt' is not supported with draft trees yet: use chains"
                      " (tree_budget=0) or lookup='off'.")
