"""The verification scheduler: its choice on hand-made inputs, the causal rule, end to end.

Engine runs share one shape (batch 2, gamma 2, S_max 3, 25 new tokens) so that
they share one compiled program; cost tables are traced values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drafter_fixtures
from dloop_jax.decoding import generate
from dloop_jax.decoding import schedule as schedule_lib
from dloop_jax.errors import ConfigError

GAMMA, S_MAX, MAX_NEW = 2, 3, 25
P, Q = [5, 6, 7], [9, 1, 2, 3, 4]
W4 = schedule_lib.verify_widths(block_size=4, max_stages=3, schedule="cost")  # 1 2 3 5 9 13


# Jitted, as in the engine (and one compile per shape instead of op-by-op calls).
_jitted_choose = jax.jit(schedule_lib.choose, static_argnames=("widths", "causal"))


def _choose(c, n=None, *, active=None, costs, widths=W4, causal=False):
  c = np.asarray(c, np.float32)
  c = c[None] if c.ndim == 1 else c
  b, m = c.shape
  n = np.full((b,), m) if n is None else np.asarray(n)
  active = np.ones((b,), bool) if active is None else np.asarray(active)
  costs = np.asarray([costs[w] for w in widths] if isinstance(costs, dict) else costs, np.float32)
  choice = _jitted_choose(confidence=jnp.asarray(c), num_drafts=jnp.asarray(n, jnp.int32),
                          active=jnp.asarray(active), widths=widths,
                          costs=jnp.asarray(costs), causal=causal)
  return widths[int(choice.branch)], np.asarray(choice.num_verified).tolist()


def _reference(c, n, active, costs, widths):
  """Brute force: the width maximising sum_r E_r(min(n_r, w - 1)) / cost(w)."""
  best, best_ratio = None, -math.inf
  most = max([0] + [x for x, a in zip(n, active) if a])
  for a, (w, cost) in enumerate(zip(widths, costs)):
    if a > 0 and widths[a - 1] >= 1 + most:
      continue  # the narrower width already holds every draft
    tokens = 0.0
    for r in range(len(n)):
      if active[r]:
        j = min(n[r], w - 1)
        tokens += 1 + sum(np.prod(c[r][:i + 1]) for i in range(j))
    if tokens / cost > best_ratio * (1 + 1e-6):
      best, best_ratio = w, tokens / cost
  return best


# ----------------------------------------------------------------- unit tests


def test_verify_widths():
  """Stage widths 1 + s * gamma, plus 1, 2, 3 when scheduling; "off" keeps today's."""
  assert W4 == (1, 2, 3, 5, 9, 13)
  assert schedule_lib.verify_widths(block_size=4, max_stages=3, schedule="off") == (5, 9, 13)
  assert schedule_lib.verify_widths(block_size=1, max_stages=3, schedule="cost") == (1, 2, 3, 4)
  assert schedule_lib.verify_widths(block_size=2, max_stages=1, schedule="cost") == (1, 2, 3)
  assert schedule_lib.verify_widths(block_size=1, max_stages=1, schedule="cost") == (1, 2)


def test_expected_committed_by_hand():
  e = schedule_lib.expected_committed(jnp.asarray([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]]))
  np.testing.assert_allclose(np.asarray(e), [[1, 1.5, 1.75, 2.0], [1, 2, 2, 2]])


def test_choice_on_hand_made_tables():
  """E(j) / cost(1 + j) by hand, batch 1, gamma 4, S_max 3 (m = 12 drafts)."""
  flat = {w: 1.0 for w in W4}
  steep = {w: float(w) for w in W4}  # E(j) < 1 + j unless every c = 1: never worth it
  cpu = {1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6, 13: 66.8}
  assert _choose([0.9] * 12, costs=flat) == (13, [12])
  assert _choose([0.9] * 12, costs=steep) == (1, [0])
  assert _choose([1.0] * 12, costs=steep) == (1, [0])  # a tie: the narrower width
  # c = 0.5: E = 1, 1.5, 1.75, 1.875, 1.9375; per cost 1/30 = .0333, 1.5/40.4 = .0371,
  # 1.75/46 = .0380, 1.9375/51.7 = .0375: two drafts.
  assert _choose([0.5] * 12, costs=cpu) == (3, [2])
  assert _choose([0.3] * 12, costs=cpu) == (1, [0])  # 1.3/40.4 = .0322 < .0333
  assert _choose([0.95] * 12, costs=cpu) == (13, [12])
  # A width between stages: 3 drafts pay for width 5, which then verifies 4.
  assert _choose([0.75] * 12, costs={**cpu, 5: 48.0}) == (5, [4])
  # Rows never verify more than they drafted, and a width past every draft is not chosen.
  assert _choose([0.99] * 12, n=[4], costs=flat) == (5, [4])
  assert _choose([0.99] * 12, n=[0], costs=flat) == (1, [0])


def test_batch_decides_once_for_all_active_rows():
  """The batch maximises the sum of its rows' E_r over the one forward's cost."""
  sure, unsure = [0.95] * 4, [0.05] * 4
  widths = schedule_lib.verify_widths(block_size=4, max_stages=1, schedule="cost")  # 1 2 3 5
  costs = {1: 1.0, 2: 1.2, 3: 1.4, 5: 2.1}
  assert _choose(sure, costs=costs, widths=widths) == (5, [4])  # 4.524 / 2.1 > 2.8525 / 1.4
  assert _choose(unsure, costs=costs, widths=widths) == (1, [0])
  # Together: w=1 2/1, w=2 3/1.2, w=3 (2.8525 + 1.0525)/1.4 = 2.79, w=5 (4.524 + 1.0526)/2.1
  # = 2.66.
  assert _choose([sure, unsure], costs=costs, widths=widths) == (3, [2, 2])
  # An unsure row that drafted less verifies what it has.
  assert _choose([sure, unsure], n=[4, 1], costs=costs, widths=widths) == (3, [2, 1])
  # Inactive rows do not count, and verify nothing.
  assert _choose([sure, unsure], active=[False, True], costs=costs, widths=widths) == (1, [0, 0])
  assert _choose([sure, unsure], active=[True, False], costs=costs, widths=widths) == (5, [4, 0])


def test_argmax_matches_brute_force():
  rng = np.random.default_rng(0)
  for trial in range(60):
    b = int(rng.integers(1, 5))
    c = rng.uniform(0, 1, (b, 12)) ** rng.uniform(0.2, 3)
    n = rng.choice([0, 4, 8, 12], size=b)
    active = rng.uniform(size=b) < 0.8
    costs = np.sort(rng.uniform(1, 3, len(W4))) if trial % 3 else rng.uniform(1, 3, len(W4))
    want = _reference(c, n, active, costs, W4)
    assert _choose(c, n, active=active, costs=costs)[0] == want, (c, n, active, costs)


def test_causal_rule_decides_each_draft_from_the_drafts_before_it():
  """Sampling rule: whether draft i is verified depends on c_1..c_i only.

  c_k is a function of the drafts before k; changing c_{i+1}.. (or how many
  later stages were drafted) must not change whether draft i is verified, or
  rejection sampling would be biased towards drafts that look likely.
  """
  rng = np.random.default_rng(1)
  tables = [{w: float(w) ** 0.5 for w in W4}, {1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6,
                                                13: 66.8}]
  for trial in range(40):
    b = int(rng.integers(1, 4))
    costs = tables[trial % 2] if trial % 4 < 2 else dict(zip(W4, np.sort(rng.uniform(1, 4, 6))))
    c = rng.uniform(0.2, 1, (b, 12))
    n = rng.choice([4, 8, 12], size=b)
    verified = _choose(c, n, costs=costs, causal=True)[1]
    for i in range(1, 13):
      changed = c.copy()
      changed[:, i:] = rng.uniform(0, 1, (b, 12 - i))
      stage_end = -(-i // 4) * 4  # drafts of the stage holding draft i exist with it
      n2 = np.where(n >= i, np.maximum(stage_end, rng.choice([4, 8, 12], size=b)), n)
      again = _choose(changed, n2, costs=costs, causal=True)[1]
      assert [v >= i for v in verified] == [v >= i for v in again], (trial, i, c, n, costs)
  # And it still follows the costs: flat verifies everything, steep nothing.
  assert _choose([0.9] * 12, costs={w: 1.0 for w in W4}, causal=True) == (13, [12])
  assert _choose([0.9] * 12, costs={w: float(w) for w in W4}, causal=True) == (1, [0])
  assert _choose([0.5] * 12, costs={1: 30.0, 2: 40.4, 3: 46.0, 5: 51.7, 9: 63.6, 13: 66.8},
                 causal=True) == (3, [2])


def test_draft_confidence_greedy_and_sampling():
  """Greedy: exp(logprob of the drafted argmax). Sampling: the top processed probability."""
  from dloop_jax.decoding import SamplingConfig
  logprobs = jnp.log(jnp.asarray([[0.5, 0.25]]))
  probs = jnp.asarray([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]])
  greedy = schedule_lib.draft_confidence(logprobs=logprobs, probs=None,
                                         config=SamplingConfig())
  np.testing.assert_allclose(np.asarray(greedy), [[0.5, 0.25]], rtol=1e-6)
  sampled = schedule_lib.draft_confidence(logprobs=logprobs, probs=probs,
                                          config=SamplingConfig(temperature=1.0))
  np.testing.assert_allclose(np.asarray(sampled), [[0.7, 0.6]], rtol=1e-6)


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def drafters(tiny):
  return {
      "oracle": drafter_fixtures.oracle(tiny),
      "sharp": drafter_fixtures.TargetDrafter(tiny, target_weight=4.0, noise_scale=0.0),
      "perturbed": drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3),
  }


def _dloop(tiny, drafter, costs, gate=-2.0, **kw):
  # The scheduler alone: every round drafts (no back-off, `test_draft_policy.py`).
  return generate(tiny, [P, Q], max_new_tokens=MAX_NEW, mode="dloop", drafter=drafter,
                  block_size=GAMMA, gate=gate, max_stages=S_MAX, costs=costs, draft_backoff=0,
                  **kw)


def test_choosable_widths_drop_widths_a_wider_one_nearly_matches():
  widths = (1, 2, 3, 5, 9, 13)
  flat = (1.0, 1.003, 1.006, 1.013, 1.025, 1.038)
  assert schedule_lib.choosable_widths(widths, flat, tolerance=0.02) == (1, 5, 13)
  assert schedule_lib.choosable_widths(widths, flat, tolerance=0.1) == (1, 13)
  assert schedule_lib.choosable_widths(widths, flat, tolerance=0.0) == widths
  steep = (30.0, 40.4, 46.0, 51.7, 63.6, 66.8)  # a CPU's: every width pays somewhere
  assert schedule_lib.choosable_widths(widths, steep, tolerance=0.02) == widths
  # A wider width that costs less than a narrower one replaces it.
  assert schedule_lib.choosable_widths((1, 3, 5), (1.0, 2.0, 1.5), tolerance=0.01) == (1, 5)
  with pytest.raises(ValueError, match="tolerance"):
    schedule_lib.choosable_widths(widths, flat, tolerance=-0.1)


def test_flat_table_verifies_everything_steep_nothing(tiny, drafters):
  """Flat: every draft verified (as schedule="off"); steep: plain decode steps only."""
  ar = generate(tiny, [P, Q], max_new_tokens=MAX_NEW)
  flat = _dloop(tiny, drafters["perturbed"], {1: 1.0, 7: 1.0})
  off = _dloop(tiny, drafters["perturbed"], None, schedule="off")
  assert flat.tokens == off.tokens == ar.tokens
  # A flat table compiles the plain step and the widest verification only.
  assert off.widths == (3, 5, 7) and flat.widths == (1, 7)
  for row in flat.rows:
    assert row.verified == row.drafted > 0 and row.plain_rounds == 0
  steep = _dloop(tiny, drafters["perturbed"], {w: 10.0 ** w for w in range(1, 8)})
  assert steep.tokens == ar.tokens
  for row in steep.rows:
    assert row.verified == row.accepted == 0 and row.drafted > 0
    assert row.plain_rounds == row.rounds == MAX_NEW - 1 == row.target_tokens
  assert steep.schedule == "cost" and off.schedule == "off"
  assert steep.widths == (1, 2, 3, 5, 7)


def test_confident_drafter_is_verified_weak_one_mostly_not(tiny, drafters):
  """On the CPU table a sure drafter's drafts are verified, the perturbed drafter's often not.

  The plain oracle drafts the target's argmax, always accepted, but with the
  target's probability (often < 0.5 here): its confidence says little about
  greedy acceptance. The sharpened one (4x the target's logits) is sure.
  """
  sure = _dloop(tiny, drafters["sharp"], None, gate=-math.inf)
  for row in sure.rows:
    assert row.verified == row.accepted and row.plain_rounds == 0
    assert row.accepted > 0.8 * row.drafted
  weak = _dloop(tiny, drafters["perturbed"], None)
  total = weak.total
  assert 0 < total.plain_rounds < total.rounds
  assert total.accepted <= total.verified < total.drafted


def test_bad_schedule_and_cost_tables(tiny, drafters, tmp_path):
  kw = dict(max_new_tokens=4, mode="dloop", drafter=drafters["oracle"], block_size=GAMMA,
            max_stages=S_MAX)
  with pytest.raises(ConfigError, match=r"schedule must be one of \('cost', 'off'\), got 'all'"):
    generate(tiny, [P], schedule="all", **kw)
  with pytest.raises(ConfigError, match=r"measures widths up to 5, but widths \[7\] are verified"):
    generate(tiny, [P], costs={1: 1.0, 5: 2.0}, **kw)
  with pytest.raises(ConfigError, match="not width 1"):
    generate(tiny, [P], costs={2: 1.0, 9: 2.0}, **kw)
  bad = tmp_path / "bad.json"
  bad.write_text("{\"1\": 30.0}")
  with pytest.raises(ConfigError, match=r"needs a \"costs\" object"):
    generate(tiny, [P], costs=str(bad), **kw)
  with pytest.raises(ConfigError, match="costs must be None, a CostTable"):
    generate(tiny, [P], costs=[1.0, 2.0], **kw)
