"""EAGLE-3 drafter: engine losslessness, train / inference agreement, vocab maps, errors."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
import reference
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.decoding import tree as tree_lib
from dloop_jax.drafters import (Eagle3Drafter, Frozen, build_drafter, default_drafter_config,
                                draft_vocab_from_counts, token_counts)
from dloop_jax.errors import ConfigError, DrafterMismatchError
from dloop_jax.models.transformer import tiny_target
from lossless import assert_same_or_near_tie

GAMMA = 3


@pytest.fixture(scope="module")
def examples(tiny):
  return draft_training.make_examples(tiny, taps=(0, 1), num_prompts=64, max_new_tokens=40,
                                      seed=0)


def _batches(examples):
  return [draft_training.pack_batch(examples[i:i + 16], seq_len=48)
          for i in range(0, len(examples), 16)]


@pytest.fixture(scope="module")
def drafters(tiny, examples):
  """Untrained and briefly trained, full and reduced (48 of 64 ids) vocabulary."""
  counts = token_counts(np.concatenate([e["tokens"] for e in examples]),
                        np.concatenate([e["loss_mask"] for e in examples]), vocab_size=64)
  out = {}
  for vd in (0, 48):
    config = {"kind": "eagle3", "block_size": GAMMA, "draft_vocab_size": vd}
    out[f"untrained_v{vd}"] = build_drafter(config, target=tiny, rngs=nnx.Rngs(0),
                                            token_counts=counts)
    trained = build_drafter(config, target=tiny, rngs=nnx.Rngs(0), token_counts=counts)
    draft_training.train(trained, _batches(examples), objective="eagle3_ttt",
                         cfg={"ttt_steps": GAMMA}, steps=60)
    out[f"trained_v{vd}"] = trained
  return out


def _prompts(rng, batch):
  return [rng.integers(0, 64, size=int(rng.integers(2, 12))).tolist() for _ in range(batch)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless(tiny, drafters, batch):
  rng = np.random.default_rng(batch)
  prompts = _prompts(rng, batch)
  max_new = 17  # not a multiple of any block: the limit falls inside one
  ar = generate(tiny, prompts, max_new_tokens=max_new)
  runs = [("sd", GAMMA, 1, -0.5)] + [("dloop", 2, 3, g) for g in (-math.inf, -1.0, math.inf)]
  for name, drafter in drafters.items():
    if name.endswith("v48") and batch == 1:
      continue  # the reduced vocabulary is one more compile: once is enough
    for mode, gamma, s_max, gate in runs:
      # A flat cost table verifies every draft; the session's CPU table (None) lets the
      # scheduler verify fewer, often none with these weak drafters. Both on one program
      # (every width compiled; a flat table's fewer widths: tests/test_engine_greedy.py).
      flat = mode == "sd" or gate == -math.inf
      out = generate(tiny, prompts, max_new_tokens=max_new, mode=mode, drafter=drafter,
                     block_size=gamma, gate=gate, max_stages=s_max,
                     costs={1: 1.0, 7: 1.0} if flat else None, width_tolerance=0.0)
      for p, want, got in zip(prompts, ar.tokens, out.tokens):
        assert len(got) == max_new
        assert_same_or_near_tie(tiny, p, want, got)
  if batch == 3:
    # Dynamic draft trees (EAGLE-2), with DLoop stages grown from the best path (one
    # program: the gate is traced; g = -1 often stops after one stage).
    for mode, gamma, s_max, gate in [("dloop", 2, 3, -math.inf), ("dloop", 2, 3, -1.0)]:
      out = generate(tiny, prompts, max_new_tokens=max_new, mode=mode,
                     drafter=drafters["trained_v48"], block_size=gamma, gate=gate,
                     max_stages=s_max, tree_budget=6)
      for p, want, got in zip(prompts, ar.tokens, out.tokens):
        assert_same_or_near_tie(tiny, p, want, got)
      assert out.total.accepted > 0


def test_trained_drafter_accepts_more(tiny, drafters):
  prompts = _prompts(np.random.default_rng(5), 3)
  taus = {n: generate(tiny, prompts, max_new_tokens=17, mode="sd", drafter=d,
                      block_size=GAMMA, schedule="off").total.acceptance_length for n, d in drafters.items()}
  assert taus["trained_v0"] > taus["untrained_v0"], taus


@pytest.mark.parametrize("mode,name", [("sd", "trained_v0"), ("dloop", "trained_v48")])
def test_sampling_first_two_tokens(tiny, drafters, mode, name):
  sampling = SamplingConfig(temperature=1.0, top_k=6)
  prompt = [3, 14, 15]
  n = 3000
  out = generate(tiny, [prompt] * n, max_new_tokens=2, mode=mode, drafter=drafters[name],
                 block_size=2, gate=-math.inf, max_stages=2, sampling=sampling, seed=11)
  samples = [tuple(t[:2]) for t in out.tokens]
  exact = reference.exact_distribution(tiny, prompt, sampling, depth=2)
  assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3


def test_training_time_test_matches_inference(tiny, examples, drafters):
  drafter = drafters["trained_v48"]
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  steps = 3
  hidden = nnx.jit(lambda d, b: d.ttt_hiddens(
      tokens=b["tokens"], features=b["features"], positions=b["positions"],
      segment_ids=b["segment_ids"], num_steps=steps))(drafter, jax.tree.map(jnp.asarray, batch))
  tokens = batch["tokens"]
  n = 12
  state = draft_training.commit_prefix(drafter, tokens, batch["features"], n)
  np.testing.assert_allclose(state.hidden, hidden[0][:, n - 1], atol=1e-5)
  read = nnx.jit(lambda d, st: d._read_pending(st))  # pylint: disable=protected-access
  for i in range(1, steps):
    # Teacher-forced chain: the pending "draft" is the ground-truth token.
    state = read(drafter, state.replace(pending=jnp.asarray(tokens[:, n + i])))
    np.testing.assert_allclose(state.hidden, hidden[i][:, n - 1], atol=1e-5)


def test_stages_continue_the_chain_and_commit_rolls_back(tiny, examples, drafters):
  drafter = drafters["trained_v0"]
  batch = draft_training.pack_batch(examples[:3], seq_len=32)
  tokens, features = batch["tokens"], batch["features"]
  n = 10
  state = draft_training.commit_prefix(drafter, tokens, features, n)
  key = jax.random.key(0)
  greedy = SamplingConfig()
  draft = draft_training.draft_stage
  _, one = draft(drafter, state, key, block_size=4, sampling=greedy)
  s1, a = draft(drafter, state, key, block_size=2, sampling=greedy)
  s2, b = draft(drafter, s1, key, block_size=2, sampling=greedy)
  np.testing.assert_array_equal(one.tokens, np.concatenate([a.tokens, b.tokens], axis=1))
  np.testing.assert_allclose(one.logprobs, np.concatenate([a.logprobs, b.logprobs], axis=1),
                             atol=1e-5)
  # Verification accepts k of them: commit rolls back and reads the target's features.
  counts = np.array([1, 3, 5], np.int32)
  nxt = np.concatenate([tokens[:, 1:], np.zeros((3, 1), np.int32)], axis=1)
  w = 6
  after = draft_training.commit(drafter, s2, jnp.asarray(tokens[:, n:n + w]),
                                jnp.asarray(features[:, n:n + w]), jnp.asarray(nxt[:, n:n + w]),
                                jnp.full((3,), n, jnp.int32), jnp.asarray(counts))
  for r in range(3):
    fresh = draft_training.commit_prefix(drafter, tokens[r:r + 1], features[r:r + 1], n + int(counts[r]))
    assert int(after.lengths[r]) == n + counts[r]
    np.testing.assert_allclose(after.hidden[r], fresh.hidden[0], atol=1e-5)
    _, want = draft(drafter, fresh, key, block_size=3, sampling=greedy)
    _, got = draft(drafter, jax.tree.map(lambda x: x[r:r + 1] if x.ndim else x, after), key,
                   block_size=3, sampling=greedy)
    np.testing.assert_array_equal(want.tokens, got.tokens)


def _chain_scores(drafter, state, path):
  """Teacher-forced chain along path [R, L]: cumulative log q [R, L], and the state after
  reading path[:, :L - 1] with path[:, L - 1] pending (as after a greedy stage)."""
  total, out = 0.0, []
  for i in range(path.shape[1]):
    lp = jax.nn.log_softmax(drafter.draft_logits(state.hidden))
    total = total + jnp.take_along_axis(lp, drafter.to_draft_ids(path[:, i])[:, None], axis=1)[:, 0]
    out.append(total)
    if i < path.shape[1] - 1:
      state = drafter._read_pending(state.replace(pending=path[:, i]))  # pylint: disable=protected-access
  return jnp.stack(out, axis=1), state.replace(pending=path[:, -1])


def test_dynamic_tree_scores_paths_like_the_chain(tiny, examples, drafters):
  """EAGLE-3's dynamic tree: each node scores its path's chain log q (tree mask right), the
  selection is prefix-closed with distinct siblings, and the state continues along the
  best path exactly as a chain that drafted it."""
  drafter = drafters["trained_v48"]
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  n, gamma, budget = 10, 3, 8
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], n)

  @nnx.jit
  def stage(d, st):
    st, ts = d.draft_tree_stage(st, block_size=gamma, budget=budget)
    return st, ts, tree_lib.select(ts.candidates, budget=budget,
                                   keep_best_path=jnp.ones((2,), bool))

  after, ts, (tree, best_end) = stage(drafter, state)
  nodes = tree.num_nodes  # the best path keeps gamma slots beside the budget
  assert nodes == budget + gamma
  tokens, parents, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths))
  assert np.asarray(tree.valid).all()
  paths = np.zeros((2, nodes, gamma), np.int32) + int(drafter.d2t[...][0])
  for r in range(2):
    for i in range(nodes):
      assert parents[r, i] < i  # parents first: prefix-closed
      siblings = tokens[r][(parents[r] == parents[r, i]) & (np.arange(nodes) != i)]
      assert tokens[r, i] not in siblings
      node, d = i, depths[r, i]
      while node != tree_lib.NO_PARENT:
        paths[r, i, depths[r, node] - 1] = tokens[r, node]
        node = parents[r, node]
      assert d == 1 + (0 if parents[r, i] < 0 else depths[r, parents[r, i]])
  tiled = jax.tree.map(lambda x: jnp.repeat(x, nodes, axis=0) if x.ndim else x, state)
  chain = nnx.jit(_chain_scores)
  want, chained = chain(drafter, tiled, jnp.asarray(paths.reshape(2 * nodes, gamma)))
  want = np.take_along_axis(np.asarray(want), depths.reshape(-1, 1) - 1, axis=1).reshape(2, nodes)
  np.testing.assert_allclose(np.asarray(tree.scores), want, atol=1e-4)
  # The best path is in the tree; the state after the stage equals the chain's along it.
  at = np.arange(2) * nodes + np.asarray(best_end)
  np.testing.assert_allclose(np.asarray(ts.candidates.best_score), want.reshape(-1)[at],
                             atol=1e-4)
  assert (depths[np.arange(2), np.asarray(best_end)] == gamma).all()
  for name in ("hidden", "lengths", "pending"):
    np.testing.assert_allclose(np.asarray(getattr(after, name)),
                               np.asarray(getattr(chained, name))[at], atol=1e-5)
  np.testing.assert_allclose(np.asarray(after.k)[:, :n + gamma - 1],
                             np.asarray(chained.k)[at, :n + gamma - 1], atol=1e-5)


def test_reduced_vocabulary_maps_and_probs(tiny, drafters, examples):
  drafter = drafters["trained_v48"]
  d2t = np.asarray(drafter.d2t[...])
  assert d2t.shape == (48,) and np.all(np.diff(d2t) > 0)
  t2d = np.asarray(drafter.t2d[...])
  assert np.all(t2d[d2t] == np.arange(48)) and np.sum(t2d >= 0) == 48
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], 8)
  sampling = SamplingConfig(temperature=1.0, top_p=0.9)
  _, stage = draft_training.draft_stage(drafter, state, jax.random.key(3), block_size=3,
                                        sampling=sampling)
  assert stage.probs.shape == (2, 3, 64)
  np.testing.assert_allclose(np.asarray(stage.probs).sum(-1), 1.0, atol=1e-5)
  outside = np.setdiff1d(np.arange(64), d2t)
  assert np.all(np.asarray(stage.probs)[..., outside] == 0)
  assert np.all(np.isin(np.asarray(stage.tokens), d2t))
  assert np.all(np.asarray(stage.logprobs) <= 0)


def test_draft_vocab_from_counts():
  counts = np.array([5, 0, 9, 9, 1, 7])
  d2t, t2d = draft_vocab_from_counts(counts, 3)
  np.testing.assert_array_equal(d2t, [2, 3, 5])
  np.testing.assert_array_equal(t2d, [-1, -1, 0, 1, -1, 2])
  d2t, _ = draft_vocab_from_counts(np.zeros(6), 2)  # ties: lower ids
  np.testing.assert_array_equal(d2t, [0, 1])
  with pytest.raises(ConfigError):
    draft_vocab_from_counts(counts, 7)
  np.testing.assert_array_equal(token_counts(np.array([[1, 2, 2]]), np.array([[0, 1, 1]]),
                                             vocab_size=4), [0, 0, 2, 0])


def test_config_round_trip_and_frozen_weights(tiny):
  drafter = build_drafter({"kind": "eagle3", "draft_vocab_size": 32, "block_size": 5},
                          target=tiny, rngs=nnx.Rngs(0))
  assert isinstance(drafter, Eagle3Drafter) and drafter.kind == "autoregressive"
  config = json.loads(json.dumps(drafter.drafter_config()))
  again = build_drafter(config, target=tiny, rngs=nnx.Rngs(1))
  assert again.drafter_config() == config
  assert config["kind"] == "eagle3" and config["block_size"] == 5
  assert drafter.target_fingerprint == tuple(sorted(tiny.config.fingerprint.items()))
  frozen = nnx.state(drafter, Frozen)
  params = nnx.state(drafter, nnx.Param)
  assert {str(p[0]) for p, _ in nnx.to_flat_state(frozen)} == {"embed"}
  assert "embed" not in {str(p[0]) for p, _ in nnx.to_flat_state(params)}
  assert default_drafter_config("eagle3", tiny.config)["draft_vocab_size"] == 0
  with pytest.raises(ConfigError, match="num_layers"):
    build_drafter({"kind": "eagle3", "num_layers": 2}, target=tiny, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="did you mean"):
    build_drafter({"kind": "eagle3", "blok_size": 2}, target=tiny, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="taps"):
    build_drafter({"kind": "eagle3", "taps": [0, 5]}, target=tiny, rngs=nnx.Rngs(0))


def test_target_mismatch_raises(tiny):
  drafter = build_drafter({"kind": "eagle3"}, target=tiny, rngs=nnx.Rngs(0))
  other = tiny_target(seed=1, hidden_size=48)
  with pytest.raises(DrafterMismatchError, match="hidden_size"):
    generate(other, [[1, 2, 3]], max_new_tokens=4, mode="sd", drafter=drafter)
  with pytest.raises(DrafterMismatchError):
    drafter.check_target(tiny_target(seed=1, vocab_size=80).config)


def test_default_sizing_for_the_real_target():
  """A drafting stage reads a small fraction of the weights a target forward reads."""
  config = draft_training.smollm2_shaped_config()
  d = draft_training.abstract_drafter({"kind": "eagle3"}, config)
  assert d.drafter_config()["draft_vocab_size"] == 8192
  assert d.drafter_config()["taps"] == [1, 14, 26]
  layer = draft_training.num_weights(d.wqkv, d.wo, d.w_gate_up, d.w_down)
  head = draft_training.num_weights(d.lm_head)
  gamma = d.block_size
  stage = gamma * (layer + head)  # a later stage; the first one has one layer forward less
  target = config.num_params()
  assert stage / target < 0.3, (stage, target)
  assert (layer + head) / target < 0.07


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_export_and_load_keep_the_draft_vocabulary(tiny, drafters, tmp_path, weights):
  from dloop_jax.drafters import io as drafter_io  # pylint: disable=g-import-not-at-top
  drafter = drafters["trained_v48"]
  path = drafter_io.export_drafter(drafter, tmp_path / "export", target_name="tiny",
                                   weights=weights)
  loaded = drafter_io.load_drafter(path, target=tiny)
  np.testing.assert_array_equal(loaded.d2t[...], drafter.d2t[...])
  np.testing.assert_array_equal(loaded.t2d[...], drafter.t2d[...])
  np.testing.assert_allclose(loaded.lm_head[...], drafter.lm_head[...], atol=2e-2)
  assert loaded.drafter_config() == drafter.drafter_config()
  info = drafter_io.read_info(path)
  assert info["params"]["lm_head"]["dtype"] == weights
  assert info["params"]["mlp_norm"]["dtype"] == "bfloat16"  # vectors stay 16-bit
  if weights == "int8":
    # Each value is within half its group's step, plus two bf16 roundings (stored, loaded).
    want = np.asarray(drafter.lm_head[...], np.float32)
    g = drafter_io.int8_group(want.shape)
    step = np.repeat(np.abs(want.reshape(want.shape[0], -1, g)).max(-1) / 127, g, axis=-1)
    error = np.abs(np.asarray(loaded.lm_head[...], np.float32) - want)
    assert (error <= 0.5 * step.reshape(want.shape) + np.abs(want) * 2 ** -7 + 1e-7).all()
    assert info["version"] == 2 and error.max() > 0
  with pytest.raises(ConfigError, match="bfloat16 weights"):
    drafter_io.export_drafter(drafter, tmp_path / "hf", format="hf", weights="int8")
