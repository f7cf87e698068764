"""The prompt-lookup stage (`decoding.lookup`, `generate(lookup="prompt")`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drafter_fixtures
from dloop_jax.decoding import DecodingConfig, SamplingConfig, generate
from dloop_jax.decoding import lookup as lookup_lib
from dloop_jax.errors import ConfigError
from lossless import assert_same_or_near_tie

# One compiled program per shape (an eager run dispatches every small op).
_propose_jit = jax.jit(lookup_lib.propose, static_argnames=("block_size", "min_match"))


def _propose(rows, *, block_size=4, min_match=2, width=16):
  history = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    history[i, :len(r)] = r
  p = _propose_jit(history=jnp.asarray(history),
                         lengths=jnp.asarray([len(r) for r in rows], jnp.int32),
                         block_size=block_size, min_match=min_match)
  return [(np.asarray(p.tokens[i, :int(p.num_tokens[i])]).tolist(), int(p.match[i]))
          for i in range(len(rows))]


def test_propose_matches_on_hand_made_histories():
  got = _propose([
      [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4],  # suffix 2 3 4 occurred: 3 tokens matched
      [7, 8, 9, 1, 2, 8, 8, 5, 5, 9, 1],  # only 9 1 occurred (8 9 1 did not)
      [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],  # no repeat
      [4, 5, 1, 4, 5, 2, 3, 4, 5],  # 4 5 occurred twice: the newest wins
      [1, 2, 3, 1, 2, 3],  # the occurrence ends 3 tokens before the end: 3 tokens follow it
      [5, 5, 5],  # the suffix 5 5 overlaps its occurrence: 1 token follows it
  ])
  assert got == [([5, 6, 7, 9], 3), ([2, 8, 8, 5], 2), ([], 0), ([2, 3, 4, 5], 2),
                 ([1, 2, 3], 3), ([5], 2)]


def test_propose_minimum_match_and_padding_past_the_length():
  # A single-token match counts only with min_match=1; tokens past the
  # length (here 9s) are never proposed.
  rows = [[3, 6, 2, 7, 6]]
  assert _propose(rows) == [([], 0)]
  assert _propose(rows, min_match=1) == [([2, 7, 6], 1)]
  history = jnp.asarray([[1, 2, 7, 1, 2, 9, 9, 9]], jnp.int32)
  p = _propose_jit(history=history, lengths=jnp.asarray([5]), block_size=4, min_match=2)
  assert int(p.num_tokens[0]) == 3 and np.asarray(p.tokens[0, :3]).tolist() == [7, 1, 2]


def test_committed_history_joins_prompt_and_output():
  history, lengths = lookup_lib.committed_history(
      prompts=jnp.asarray([[1, 2, 0], [3, 4, 5]]), prompt_lengths=jnp.asarray([2, 3]),
      out=jnp.asarray([[7, 8, 0, 0], [9, 0, 0, 0]]), num_new=jnp.asarray([2, 1]))
  assert np.asarray(lengths).tolist() == [4, 4]
  assert np.asarray(history[:, :4]).tolist() == [[1, 2, 7, 8], [3, 4, 5, 9]]


# Prompts of the tiny target's own greedy answers (their first tokens appended):
# its continuations repeat themselves (29 29 29 ..., 53 47 29 ...), so the
# lookup matches 2 or 3 tokens in most rows' first 24 new tokens.
_REPEATING = (
    [54, 40, 32, 17, 19, 2, 4, 1, 11, 52, 41, 58, 25, 29, 19, 29],
    [53, 44, 45, 24, 56, 8, 37, 46, 54, 33, 24, 19, 62, 21, 47, 44],
    [5, 19, 30, 27, 25, 1, 0, 7, 0, 42, 33, 41, 11, 16, 55, 38],
)


@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_is_lossless_and_fires(tiny, batch):
  # A weak drafter (small random logits, nearly uniform over the vocabulary)
  # whose first drafts are unsure, so that the rule fires wherever the lookup
  # matched; every round drafts (no back-off).
  drafter = drafter_fixtures.TargetDrafter(tiny, target_weight=0.0, noise_scale=0.3, seed=4)
  max_new = 24
  accepted = 0
  for seed in range(3):
    # Cut the prompts at different lengths: other anchors, other matches.
    prompts = [list(p[:16 - seed]) for p in _REPEATING[seed:] + _REPEATING[:seed]][:batch]
    ar = generate(tiny, prompts, max_new_tokens=max_new)
    for mode in ("sd", "dloop"):
      out = generate(tiny, prompts, max_new_tokens=max_new, mode=mode, drafter=drafter,
                     block_size=3, max_stages=2, gate=-np.inf, schedule="off",
                     draft_backoff=0, lookup="prompt")
      for p, want, got in zip(prompts, ar.tokens, out.tokens):
        assert_same_or_near_tie(tiny, p, want, got)
      for row in out.rows:
        assert row.lookup_rounds > 0, (mode, seed)
        # A lookup round drafts one stage (then proposes at most S_max * gamma).
        assert row.lookup_rounds <= row.stage_histogram[1], (mode, seed)
      accepted += out.total.accepted
  # The random drafter's own drafts are (almost) never accepted; the
  # lookup's are, where the answer repeats.
  assert accepted >= 3 * batch


def test_dloop_lookup_round_fills_the_whole_draft_width(tiny):
  # With g = +inf dloop's drafter rounds draft one stage (gamma = 3 drafts);
  # a lookup round proposes up to the round's draft width, S_max * gamma = 6
  # (sd's: gamma). So dloop drafts more than gamma a round on average only
  # where lookup rounds proposed more than gamma tokens.
  drafter = drafter_fixtures.TargetDrafter(tiny, target_weight=0.0, noise_scale=0.3, seed=4)
  prompts = [list(p) for p in _REPEATING]
  ar = generate(tiny, prompts, max_new_tokens=24)
  common = dict(max_new_tokens=24, drafter=drafter, block_size=3, max_stages=2, gate=np.inf,
                schedule="off", draft_backoff=0, lookup="prompt")
  drafted = {}
  for mode in ("sd", "dloop"):
    out = generate(tiny, prompts, mode=mode, **common)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny, p, want, got)
    assert all(sum(row.stage_histogram[2:]) == 0 for row in out.rows), mode  # one stage a round
    assert all(row.lookup_rounds > 0 for row in out.rows), mode
    drafted[mode] = [row.drafted - 3 * row.rounds for row in out.rows]
  assert max(drafted["sd"]) <= 0
  assert max(drafted["dloop"]) > 0, drafted


def test_probability_bar(tiny):
  # A good drafter (the target itself) is unsure at some repeats of the
  # tiny target's answer, where the lookup takes over; with a bar of 0 no
  # first draft is unsure enough, and the round is the drafter's alone.
  oracle = drafter_fixtures.oracle(tiny)
  prompt = _REPEATING[0]
  ar = generate(tiny, [prompt], max_new_tokens=24)
  common = dict(max_new_tokens=24, mode="sd", drafter=oracle, block_size=3, schedule="off",
                draft_backoff=0)
  for bar, fires in ((0.0, False), (0.5, True)):
    out = generate(tiny, [prompt], lookup="prompt", lookup_max_probability=bar, **common)
    assert out.tokens == ar.tokens
    assert (out.rows[0].lookup_rounds > 0) == fires, bar


def test_lookup_errors(tiny):
  drafter = drafter_fixtures.random_drafter(tiny, seed=4)
  common = dict(max_new_tokens=4, drafter=drafter, lookup="prompt")
  with pytest.raises(ConfigError, match="sampling"):
    generate(tiny, [[1, 2]], mode="sd", sampling=SamplingConfig(temperature=1.0), **common)
  with pytest.raises(ConfigError, match="draft trees"):
    generate(tiny, [[1, 2]], mode="dloop", tree_budget=4, **common)
  with pytest.raises(ConfigError, match="mode 'sd' or 'dloop'"):
    generate(tiny, [[1, 2]], mode="ar", max_new_tokens=4, lookup="prompt")
  with pytest.raises(ConfigError, match="lookup must be one of"):
    generate(tiny, [[1, 2]], mode="sd", **{**common, "lookup": "ngram"})
  with pytest.raises(ConfigError, match="lookup_min_match"):
    generate(tiny, [[1, 2]], mode="sd", lookup_min_match=4, **common)


def test_auto_resolves_to_prompt_for_greedy_chains_only(tiny):
  drafter = drafter_fixtures.random_drafter(tiny, seed=4)
  resolve = lookup_lib.resolve
  assert resolve("auto", mode="sd", greedy=True, tree_budget=0) == "prompt"
  assert resolve("auto", mode="dloop", greedy=True, tree_budget=0) == "prompt"
  assert resolve("auto", mode="ar", greedy=True, tree_budget=0) == "off"
  assert resolve("auto", mode="sd", greedy=False, tree_budget=0) == "off"
  assert resolve("auto", mode="dloop", greedy=True, tree_budget=4) == "off"
  assert resolve("off", mode="sd", greedy=True, tree_budget=0) == "off"
  # The default config is "auto"; resolving it for a target and drafter picks the stage.
  config = DecodingConfig(mode="sd")
  assert config.lookup == "auto"
  assert config.resolved(target=tiny, drafter=drafter).lookup == "prompt"
  sampled = config.replace(sampling=SamplingConfig(temperature=1.0))
  assert sampled.resolved(target=tiny, drafter=drafter).lookup == "off"
  assert DecodingConfig().resolved(target=tiny).lookup == "off"


def test_the_default_takes_lookup_drafts_and_off_takes_none(tiny):
  # The random drafter is never sure, so wherever the answer repeats the default
  # (auto: prompt for a greedy chain) verifies the lookup's drafts instead.
  drafter = drafter_fixtures.random_drafter(tiny, seed=4)
  common = dict(max_new_tokens=24, mode="sd", drafter=drafter, block_size=3, schedule="off",
                draft_backoff=0)
  ar = generate(tiny, [_REPEATING[0]], max_new_tokens=24)
  default = generate(tiny, [_REPEATING[0]], **common)
  off = generate(tiny, [_REPEATING[0]], lookup="off", **common)
  assert default.tokens == off.tokens == ar.tokens
  assert default.rows[0].lookup_rounds > 0 and off.rows[0].lookup_rounds == 0
