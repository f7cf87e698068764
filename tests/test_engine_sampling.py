"""Sampling losslessness: sd and dloop draw from the exact target distribution.

For a tiny target we enumerate the exact distribution of the first three
generated tokens under the processed (temperature / top-k / top-p) target
distribution, draw N = 8,000 rows in one batched call, and run Pearson's
chi-square goodness-of-fit test, merging outcomes with expected count < 5 into
one cell (the usual validity condition of the chi-square approximation).

Threshold: p-value > 1e-4. The draws are seeded, so the test is deterministic;
the threshold says that a correct sampler would have to be unlucky at the
1-in-10,000 level to fail, while the wrong rules it guards against (accepting
every draft, resampling from p instead of the residual, sampling the bonus
from q) shift whole probability mass between outcomes: with the drafters below
(q far from p) they give chi-square statistics in the thousands. Power at this N:
a temperature of 0.85 instead of 1 (a far smaller shift) gives a noncentrality
of 178 over 63 degrees of freedom, a p-value below 1e-15 in 95 % of draws;
`test_chi_square_detects_a_modest_shift` checks it on the seeded draw.

Speculative runs go through the verification scheduler (which decides from
confidences that do not depend on the draft being verified) with the session's
CPU table, and with a table that forces it to verify exactly j drafts per round
(0 = plain decode steps after drafting; a batch of N rows decides once per
round, so a table is the way to force a prefix); one setting also runs with
schedule="off".
"""

from __future__ import annotations

import math

import pytest

import drafter_fixtures
from dloop_jax.decoding import SamplingConfig, generate
from reference import chi_square_pvalue, exact_distribution

N = 8_000
PROMPT = [3, 14, 15]


SETTINGS = {
    "topk4_t1": SamplingConfig(temperature=1.0, top_k=4),
    "topp_t07": SamplingConfig(temperature=0.7, top_p=0.8, top_k=6),
}


@pytest.fixture(scope="module")
def exact(tiny):
  return {name: exact_distribution(tiny, PROMPT, s) for name, s in SETTINGS.items()}


def _forcing(j):
  """A cost table under which the best prefix is exactly j drafts: free up to width
  1 + j, prohibitive past it."""
  return {w: 1.0 if w <= 1 + j else 1e6 for w in range(1, 6)}


@pytest.mark.parametrize("setting,mode,gamma,max_stages,gate,drafter_name,schedule,j", [
    ("topk4_t1", "ar", None, None, None, None, None, None),
    ("topp_t07", "ar", None, None, None, None, None, None),
    ("topk4_t1", "sd", 2, 1, 0.0, "perturbed", "cost", 0),
    ("topp_t07", "sd", 2, 1, 0.0, "random", "cost", 1),
    ("topp_t07", "dloop", 1, 2, -math.inf, "perturbed", "cost", 1),
    ("topk4_t1", "dloop", 1, 3, -1.0, "random", "cost", 2),
    ("topk4_t1", "dloop", 2, 2, -0.5, "perturbed", "cost", 1),
    ("topk4_t1", "dloop", 2, 2, -0.5, "perturbed", "off", None),
])
def test_first_three_tokens_match_target(tiny, exact, setting, mode, gamma, max_stages, gate,
                                         drafter_name, schedule, j):
  sampling = SETTINGS[setting]
  runs = [{}]
  if mode != "ar":
    make = {"perturbed": lambda: drafter_fixtures.perturbed(tiny, noise_scale=2.0, seed=5),
            "random": lambda: drafter_fixtures.random_drafter(tiny, seed=6)}[drafter_name]
    kwargs = dict(drafter=make(), block_size=gamma, max_stages=max_stages, gate=gate,
                  schedule=schedule)
    runs = [kwargs] if schedule == "off" else [
        # The default table with the drafting back-off; a forcing table with every
        # round drafting, so that it forces the verified prefix of every round (on
        # the same program: every width compiled, as the default table's steep costs do).
        dict(kwargs, costs=None),
        dict(kwargs, costs=_forcing(j), draft_backoff=0, width_tolerance=0.0)]
  for kwargs in runs:
    out = generate(tiny, [PROMPT] * N, max_new_tokens=3, mode=mode, sampling=sampling,
                   seed=11, **kwargs)
    samples = [tuple(t) for t in out.tokens]
    pvalue, stat = chi_square_pvalue(samples, exact[setting])
    assert pvalue > 1e-4, f"chi-square {stat:.1f}, p = {pvalue:.2e} ({kwargs.get('costs')})"
    if mode != "ar":
      t = out.total
      assert t.drafted > 0
      if kwargs.get("costs") is not None:  # the forced prefix: j drafts (fewer if fewer drafted)
        want = sum(c * min(stages * gamma, j) for stages, c in enumerate(t.stage_histogram))
        assert t.verified == want < t.drafted
        assert t.plain_rounds == (t.rounds if j == 0 else 0)


def test_chi_square_detects_a_modest_shift(tiny, exact):
  """Power check: exact target samples fail against temperature 0.85 instead of 1."""
  sampling = SETTINGS["topk4_t1"]
  out = generate(tiny, [PROMPT] * N, max_new_tokens=3, sampling=sampling, seed=12)
  samples = [tuple(t) for t in out.tokens]
  assert chi_square_pvalue(samples, exact["topk4_t1"])[0] > 1e-4
  shifted = exact_distribution(tiny, PROMPT, SamplingConfig(temperature=0.85, top_k=4))
  assert chi_square_pvalue(samples, shifted)[0] < 1e-6


def test_sampling_is_reproducible(tiny):
  sampling = SamplingConfig(temperature=1.0)
  prompts = [[1, 2], [3, 4, 5]]
  a = generate(tiny, prompts, max_new_tokens=12, sampling=sampling, seed=3)
  b = generate(tiny, prompts, max_new_tokens=12, sampling=sampling, seed=3)
  c = generate(tiny, prompts, max_new_tokens=12, sampling=sampling, seed=4)
  assert a.tokens == b.tokens
  assert a.tokens != c.tokens
  d = drafter_fixtures.perturbed(tiny, noise_scale=1.0)
  x = generate(tiny, prompts, max_new_tokens=12, sampling=sampling, seed=3, mode="dloop",
               drafter=d, block_size=2)
  y = generate(tiny, prompts, max_new_tokens=12, sampling=sampling, seed=3, mode="dloop",
               drafter=d, block_size=2)
  assert x.tokens == y.tokens


def test_low_temperature_equals_greedy(tiny):
  prompts = [[1, 2], [3, 4, 5, 6, 7]]
  greedy = generate(tiny, prompts, max_new_tokens=16)
  cold = generate(tiny, prompts, max_new_tokens=16, sampling=SamplingConfig(temperature=1e-5),
                  seed=9)
  assert cold.tokens == greedy.tokens
