"""Tree verification in the engine (generate(tree_budget=B)): lossless, seeded, validated.

Greedy: outputs equal `ar` (modulo the near-tie rule) for sd and dloop over
trees, budgets 4 and 8, batches 1 and 3, gates -inf / -0.5 / +inf, with the
oracle / perturbed / random test drafters and an (untrained, reduced
vocabulary) block drafter. The gate is traced and the fixture drafters share
one graph, so each (mode, budget, batch) setting compiles one program.

Sampling: the first three tokens' empirical distribution over N rows of one
batched call against the exact target distribution (chi-square, as in
test_engine_sampling.py).
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import drafter_fixtures
import model_fixtures
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.decoding.sampling import processed_probs
from dloop_jax.drafters import build_drafter
from dloop_jax.errors import ConfigError
from lossless import assert_same_or_near_tie
from reference import chi_square_pvalue

GAMMA = 3
MAX_NEW = 2 * GAMMA * 3 + 2  # the limit falls inside an accepted path


def _prompts(rng, batch):
  return [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(batch)]


@pytest.fixture(scope="module")
def drafters(tiny):
  return {
      "oracle": drafter_fixtures.oracle(tiny),
      "perturbed": drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3),
      "random": drafter_fixtures.random_drafter(tiny, seed=4),
  }


def _check_lossless(tiny, prompts, ar, out):
  for p, want, got in zip(prompts, ar.tokens, out.tokens):
    assert len(got) == MAX_NEW
    assert_same_or_near_tie(tiny, p, want, got)
  t = out.total
  assert t.accepted <= t.verified <= t.drafted


@pytest.mark.parametrize("mode,budget,batch", [
    ("sd", 4, 3), ("sd", 8, 1), ("dloop", 2, 1), ("dloop", 8, 3)])
def test_greedy_lossless(tiny, drafters, mode, budget, batch):
  rng = np.random.default_rng(budget * 10 + batch)
  gates = (-math.inf, -0.5, math.inf) if mode == "dloop" else (0.0,)
  # sd with B = 8 runs the cost-scheduled program (the best b nodes by path score, b + 1 in
  # the compiled widths 1, 2, 3, 5, 9); a flat table verifies the whole tree.
  scheduled = (mode, budget) == ("sd", 8)
  cost = (dict(schedule="cost", costs={1: 1.0, 9: 1.0}, draft_backoff=0) if scheduled else {})
  for seed in range(2):
    prompts = _prompts(rng, batch)
    ar = generate(tiny, prompts, max_new_tokens=MAX_NEW)
    for name, drafter in drafters.items():
      for g in gates:
        out = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode=mode, drafter=drafter,
                       block_size=GAMMA, max_stages=2, gate=g, tree_budget=budget, **cost)
        _check_lossless(tiny, prompts, ar, out)
        t = out.total
        assert out.schedule == ("cost" if scheduled else "off")
        assert t.verified == t.drafted
        # Every round drafts (no back-off by default) B nodes per stage, and a
        # stage that continues keeps its best path in GAMMA more.
        path = GAMMA if mode == "dloop" else 0
        assert t.drafted == sum(c * (s * budget + max(s - 1, 0) * path)
                                for s, c in enumerate(t.stage_histogram))
        if mode == "dloop" and g == math.inf or mode == "sd":
          assert t.stage_histogram[2:] == [0] * (len(t.stage_histogram) - 2)
        if name == "oracle":
          # The target's token always has the drafter's top score: the best
          # path is accepted whole whenever it is in the tree (always when a
          # stage follows: it is kept).
          assert t.accepted >= t.rounds - len(prompts)
          if mode == "dloop" and g == -math.inf:
            for row in out.rows:
              # Stage 1's best path is kept (stage 2 grows from its end) and
              # accepted whole, and at least stage 2's best first token:
              # GAMMA + 1 accepted every round but the last.
              assert row.stage_histogram[2] == row.rounds
              assert row.accepted >= (row.rounds - 1) * (GAMMA + 1)
        if name == "random":
          assert t.accepted <= t.rounds
    if scheduled:
      # Steep costs: small subtrees (the oracle's best nodes), or none (plain steps).
      out = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode=mode,
                     drafter=drafters["oracle"], block_size=GAMMA, tree_budget=budget,
                     schedule="cost", costs={1: 1.0, 2: 1.2, 3: 1.4, 9: 9.0}, draft_backoff=0)
      _check_lossless(tiny, prompts, ar, out)
      assert 0 < out.total.accepted and out.total.verified < out.total.drafted
    # The drafting back-off (traced) also drives tree rounds: pauses are plain steps.
    out = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode=mode,
                   drafter=drafters["random"], block_size=GAMMA, max_stages=2, gate=-0.5,
                   tree_budget=budget, **dict(cost, draft_backoff=4))
    _check_lossless(tiny, prompts, ar, out)
    assert out.total.plain_rounds > 0


def test_stop_token_inside_an_accepted_path(tiny, drafters):
  """A stop token on the accepted path is committed and ends the row there."""
  rng = np.random.default_rng(7)
  prompts = _prompts(rng, 3)
  free = generate(tiny, prompts, max_new_tokens=MAX_NEW)
  stop = free.tokens[0][5]
  for drafter in (drafters["oracle"], drafters["perturbed"]):
    out = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode="dloop", drafter=drafter,
                   block_size=GAMMA, max_stages=2, gate=-math.inf, tree_budget=4,
                   stop_tokens=[stop])
    for p, row, full in zip(prompts, out.tokens, free.tokens):
      cut = full.index(stop) + 1 if stop in full else len(full)
      assert_same_or_near_tie(tiny, p, full[:cut], row)
      assert len(row) == cut


@pytest.fixture(scope="module")
def block_drafter(tiny):
  return build_drafter({"kind": "block", "block_size": 4, "num_layers": 1,
                        "draft_vocab_size": 40}, target=tiny, rngs=nnx.Rngs(0))


def test_block_drafter_tree_stage_seeds_like_greedy_stage(tiny, block_drafter):
  """The tree stage's best path is the greedy stage; the state after both is the same."""
  d = block_drafter
  state = d.init_state(batch_size=2, capacity=32)
  tokens = jax.numpy.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
  features = jax.random.normal(jax.random.key(0), (2, 5, len(d.taps), tiny.config.hidden_size))
  state = d.commit(state, tokens=tokens, features=features, next_tokens=tokens + 1,
                   starts=jax.numpy.zeros((2,), jax.numpy.int32),
                   counts=jax.numpy.asarray([5, 3]))
  both = jax.jit(lambda s: (d.draft_stage(s, key=jax.random.key(1), block_size=4,
                                          sampling=SamplingConfig()),
                            d.draft_tree_stage(s, block_size=4, budget=8)))
  (greedy_state, greedy), (tree_state, stage) = both(state)
  best = np.asarray(stage.vocab)[np.asarray(stage.logprobs).argmax(-1)]
  np.testing.assert_array_equal(best, greedy.tokens)
  np.testing.assert_allclose(np.asarray(stage.logprobs).max(-1), greedy.logprobs, atol=1e-5)
  for a, b in zip(jax.tree.leaves(greedy_state), jax.tree.leaves(tree_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_block_drafter_greedy_lossless(tiny, block_drafter):
  rng = np.random.default_rng(9)
  for _ in range(2):
    prompts = _prompts(rng, 3)
    ar = generate(tiny, prompts, max_new_tokens=MAX_NEW)
    for g in (-math.inf, -0.5):
      out = generate(tiny, prompts, max_new_tokens=MAX_NEW, mode="dloop", drafter=block_drafter,
                     block_size=GAMMA, max_stages=2, gate=g, tree_budget=4)
      _check_lossless(tiny, prompts, ar, out)


N = 6_000
PROMPT = [3, 14, 15]
SAMPLING = SamplingConfig(temperature=1.0, top_k=4)


def _exact_distribution(target, prompt, sampling, depth=3):
  """`reference.exact_distribution` with jitted forwards (one program per length)."""
  @jax.jit
  def probs(tokens):
    b, t = tokens.shape
    cache = target.init_cache(batch_size=b, capacity=t)
    positions = jax.numpy.broadcast_to(jax.numpy.arange(t)[None], (b, t))
    return processed_probs(target(tokens, positions=positions, cache=cache).logits[:, -1],
                           sampling)

  dist = {(): 1.0}
  for _ in range(depth):
    seqs = list(dist)
    rows = np.asarray(probs(jax.numpy.asarray([prompt + list(q) for q in seqs], jax.numpy.int32)),
                      np.float64)
    dist = {q + (int(tok),): dist[q] * row[tok]
            for q, row in zip(seqs, rows) for tok in np.nonzero(row > 0)[0]}
  return dist


def test_sampling_first_three_tokens_match_target(tiny):
  """DDTree's rule (walk on the target's own samples) draws from the target distribution."""
  exact = _exact_distribution(tiny, PROMPT, SAMPLING)
  np.testing.assert_allclose(sum(exact.values()), 1.0, rtol=1e-5)
  drafter = drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=5)
  # schedule="cost" verifies the best b nodes (b + 1 in 1, 2, 3, 5, 11: two stages of 4 and
  # the first one's best path of 2), chosen from the drafter's scores alone: a smaller tree,
  # still walked on the target's samples.
  out = generate(tiny, [PROMPT] * N, max_new_tokens=3, mode="dloop", drafter=drafter,
                 block_size=2, max_stages=2, gate=-math.inf, tree_budget=4, sampling=SAMPLING,
                 seed=11, schedule="cost", costs={1: 1.0, 3: 1.1, 5: 1.5, 11: 4.0},
                 draft_backoff=0)
  samples = [tuple(t) for t in out.tokens]
  pvalue, stat = chi_square_pvalue(samples, exact)
  assert pvalue > 1e-4, f"chi-square {stat:.1f}, p = {pvalue:.2e}"
  # Power: the same samples fail against a modestly shifted distribution.
  shifted = _exact_distribution(tiny, PROMPT, SamplingConfig(temperature=0.85, top_k=4))
  assert chi_square_pvalue(samples, shifted)[0] < 1e-6
  t = out.total
  # The trees were used: two stages (the second grown from the first's best path), and
  # the scheduler verified part of them.
  assert t.accepted > 0.2 * N and t.stage_histogram[2] == t.rounds
  assert 0 < t.verified < t.drafted


@pytest.mark.parametrize("kwargs,match", [
    (dict(tree_budget=-1), "tree_budget must be an int >= 0"),
    (dict(tree_budget=2.0), "tree_budget must be an int >= 0"),
    (dict(tree_budget=True), "tree_budget must be an int >= 0"),
    (dict(tree_budget=4, mode="ar", drafter=None), "needs mode 'sd' or 'dloop'"),
])
def test_bad_tree_arguments(tiny, drafters, kwargs, match):
  args = dict(max_new_tokens=4, mode="sd", drafter=drafters["oracle"], block_size=3)
  args.update(kwargs)
  with pytest.raises(ConfigError, match=match):
    generate(tiny, [[1, 2]], **args)


def test_drafter_without_trees(tiny):
  dspark = build_drafter({"kind": "dspark", "block_size": 4, "num_layers": 1}, target=tiny,
                         rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="does not yet"):
    generate(tiny, [[1, 2]], max_new_tokens=4, mode="sd", drafter=dspark, block_size=3,
             tree_budget=4)


def test_cli_tree_budget_error(tmp_path):
  """A bad `python -m infer --tree-budget`: a one-line error, no traceback."""
  model = model_fixtures.tiny_hf_model("llama_tied")
  gguf = model_fixtures.write_gguf(model, str(tmp_path / "tiny.gguf"))
  proc = subprocess.run(
      [sys.executable, "-m", "infer", "--target", gguf, "--mode", "ar", "--tree-budget", "-1",
       "--max-new-tokens", "2"], cwd=pathlib.Path(__file__).resolve().parents[1],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "--tree-budget must be an int >= 0" in last, proc.stderr
