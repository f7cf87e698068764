"""Draft sources that need no training (`infer.bench.lookup_simulation`): the simulation's core
on hand-made sequences whose answers are known by construction."""

from __future__ import annotations

import numpy as np

from infer.bench import lookup_simulation as sim


def _seq(*tokens):
  return np.asarray(tokens, np.int32)


def test_prompt_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
  draft, n = sim.prompt_lookup(_seq(1, 2, 3, 9, 1, 2, 3), 6)
  assert (draft.tolist(), n) == ([9, 1, 2, 3], 3)
  # [6, 1, 2] is new, [1, 2] occurs at 0 and 3: the latest wins; the suffix itself does not count.
  draft, n = sim.prompt_lookup(_seq(1, 2, 5, 1, 2, 6, 1, 2), 7)
  assert (draft.tolist(), n) == ([6, 1, 2], 2)
  # Only a 1-gram matches, and the draft stops at the anchor (nothing later is known).
  draft, n = sim.prompt_lookup(_seq(5, 1, 2, 7, 1, 2, 8, 4, 2, 99), 8)
  assert (draft.tolist(), n) == ([8, 4, 2], 1)
  draft, n = sim.prompt_lookup(_seq(1, 2, 3), 2)
  assert (draft.tolist(), n) == ([], 0)


def test_ngram_table_proposes_the_most_frequent_continuation_of_answers():
  table = sim.NgramTable.build(
      [_seq(7, 8, 1, 2, 3, 4), _seq(7, 8, 1, 2, 5, 6), _seq(9, 8, 1, 2, 3, 4)], [2, 2, 2])
  # (8, 1, 2) is followed by [3, 4] twice and by [5, 6] once; past the answers' ends: nothing.
  draft, n = table.propose(_seq(5, 8, 1, 2))
  assert (draft.tolist(), n) == ([3, 4], 3)
  draft, n = table.propose(_seq(4, 4, 8))  # backs off to the 1-gram (8,)
  assert (draft.tolist(), n) == ([1, 2, 3, 4], 1)
  # 7 is never followed by an answer token (it precedes the prompt's last token), 99 is unseen.
  assert table.propose(_seq(7))[1] == 0
  assert table.propose(_seq(99))[1] == 0
  # A tie between continuations goes to the smaller ids.
  tie = sim.NgramTable.build([_seq(1, 5, 6), _seq(1, 3, 6)], [1, 1], gamma=2)
  assert tie.propose(_seq(1))[0].tolist() == [3, 6]


def test_tau_runs_rounds_in_sequence():
  assert sim.accepted_length([4, 5, 0, 7], [4, 5, 6, 7]) == 2
  # Round at 0 accepts 2 (commits 3), at 3 accepts 1, at 5 and 6 none: 7 tokens in 4 rounds.
  assert sim.tau([2, 9, 9, 1, 9, 0, 0], length=8) == (7, 4)
  # The last round commits only what is left of the answer.
  assert sim.tau([4, 4], length=3) == (2, 1)
  assert sim.tau([], length=1) == (0, 0)
  rows = [{"N": (4, 2)}, {"N": (2, 2)}]
  value, se = sim.bootstrap(rows, "N", samples=50)
  assert value == 1.5 and se > 0


def test_answer_rounds_combines_the_sources_where_the_drafter_fails():
  # Prompt [1, 2, 9, 1], answer [2, 9, 5, 5]; the drafter's drafts are never accepted.
  tokens, start = _seq(1, 2, 9, 1, 2, 9, 5, 5), 4
  wrong = np.zeros((3, sim.GAMMA), np.int32)
  table = sim.NgramTable.build([_seq(7, 7, 7, 8)], [2])
  unsure = sim.answer_rounds(tokens=tokens, answer_start=start, neural=wrong,
                             p1=np.full(3, 0.1), table=table)
  # N: one token a round. P at answer token 0 matches [1, 2] (n = 2) and drafts [9, 1, 2]: one
  # accepted, then answer token 2 has no match: 3 tokens in 2 rounds.
  assert unsure["N"] == (3, 3) and unsure["G"] == (3, 3)
  assert unsure["P"] == (3, 2) and unsure["N|P oracle"] == (3, 2)
  assert unsure["N|P rule"] == (3, 2)  # n = 2 and a first draft probability below 0.5
  assert (unsure["fails"], unsure["rescued_P"], unsure["rescued_G"]) == (3, 1, 0)
  sure = sim.answer_rounds(tokens=tokens, answer_start=start, neural=wrong,
                           p1=np.full(3, 0.9), table=table)
  assert sure["N|P rule"] == (3, 3) and sure["N|P oracle"] == (3, 2)
