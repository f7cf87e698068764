"""`with_draft_vocab`: a trained full-vocabulary drafter restricted to its commonest ids.

Block, DSpark and Domino drafters: weights kept, logits at the kept ids
unchanged, drafts mapped back to target ids (and fed back to the DSpark /
Domino heads as target ids), lossless decoding.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
import reference
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.drafters import DSparkDrafter, build_drafter, with_draft_vocab
from dloop_jax.drafters import io as drafter_io
from dloop_jax.errors import ConfigError
from dloop_jax.training import config as config_lib
from dloop_jax.training import objectives
from lossless import assert_same_or_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 24
HEADS = {
    "dspark": {"kind": "dspark", "block_size": 3, "num_layers": 1, "markov_rank": 8},
    "domino": {"kind": "domino", "block_size": 3, "num_layers": 1, "gru_hidden_size": 8,
               "correction_rank": 8},
}
# The heads' output rows [V, r]: zero-initialised (an untrained head changes nothing).
HEAD_ROWS = {"dspark": "markov_w2", "domino": "correction_w2"}


@pytest.fixture(scope="module")
def full(tiny):
  drafter = build_drafter({"kind": "block", "block_size": 3, "num_layers": 1}, target=tiny,
                          rngs=nnx.Rngs(4))
  # Nonzero weights everywhere (the initialisation zeroes nothing, but make it explicit).
  nnx.update(drafter, jax.tree.map(lambda x: x + 0.01, nnx.state(drafter, nnx.Param)))
  return drafter


@pytest.fixture(scope="module")
def heads(tiny):
  """Full-vocabulary DSpark and Domino drafters whose heads change the logits."""
  out = {}
  for i, (kind, config) in enumerate(HEADS.items()):
    drafter = build_drafter(config, target=tiny, rngs=nnx.Rngs(5))
    w2 = getattr(drafter, HEAD_ROWS[kind])
    w2.set_value(jax.random.normal(jax.random.key(i), w2.get_value().shape, w2.get_value().dtype))
    out[kind] = drafter
  return out


def _counts(vocab, seed=0):
  return np.random.default_rng(seed).integers(0, 1000, size=vocab)


def _head_logits(drafter, h, prev, state=None):
  """DSpark's / Domino's (corrected) logits [..., Vd], with the rows `state` holds if given."""
  rows = {} if state is None else dict(head_rows=state.head_rows)
  if isinstance(drafter, DSparkDrafter):
    if state is not None:
      rows["markov_rows"] = state.markov_rows
    return drafter.head_logits(h, prev, **rows)
  if state is not None:
    rows["correction_rows"] = state.correction_rows
  return drafter.corrected_logits(h, prev, **rows)[1]


def test_keeps_weights_and_the_logits_of_the_kept_ids(tiny, full):
  counts = _counts(tiny.config.vocab_size)
  restricted = with_draft_vocab(full, counts, size=SIZE, target=tiny)
  d2t = np.asarray(restricted.d2t[...])
  np.testing.assert_array_equal(np.sort(d2t), np.sort(np.argsort(-counts, kind="stable")[:SIZE]))
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(full, nnx.Param)),
                               nnx.to_flat_state(nnx.state(restricted, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
  h = jax.random.normal(jax.random.key(0), (2, 3, tiny.config.hidden_size))
  np.testing.assert_allclose(np.asarray(restricted.draft_logits(h)),
                             np.asarray(full.draft_logits(h))[..., d2t], rtol=1e-6, atol=1e-6)
  # The state's head rows are the kept ids' rows.
  state = restricted.init_state(batch_size=1, capacity=8)
  assert state.head_rows.shape == (SIZE, tiny.config.hidden_size)


def test_restricted_drafter_is_lossless(tiny, full):
  restricted = with_draft_vocab(full, _counts(tiny.config.vocab_size, 1), size=SIZE, target=tiny)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 64, size=int(rng.integers(2, 10))).tolist() for _ in range(3)]
  ar = generate(tiny, prompts, max_new_tokens=12)
  for mode in ("sd", "dloop"):
    out = generate(tiny, prompts, max_new_tokens=12, mode=mode, drafter=restricted,
                   schedule="off", gate=-jnp.inf if mode == "dloop" else -0.5, max_stages=2)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny, p, want, got)


def test_refuses_what_it_cannot_restrict(tiny, full):
  counts = _counts(tiny.config.vocab_size)
  with pytest.raises(ConfigError, match="own head"):
    eagle3 = build_drafter({"kind": "eagle3", "block_size": 3, "draft_vocab_size": 0},
                           target=tiny, rngs=nnx.Rngs(0))
    with_draft_vocab(eagle3, counts, size=SIZE, target=tiny)
  restricted = with_draft_vocab(full, counts, size=SIZE, target=tiny)
  with pytest.raises(ConfigError, match="already drafts over a vocabulary of 24"):
    with_draft_vocab(restricted, counts, size=16, target=tiny)
  with pytest.raises(ConfigError, match=r"must be in \(0, 64\)"):
    with_draft_vocab(full, counts, size=64, target=tiny)
  with pytest.raises(ConfigError, match=r"shape \(64,\)"):
    with_draft_vocab(full, counts[:10], size=SIZE, target=tiny)


def test_cli_needs_both_flags_before_loading_anything():
  proc = subprocess.run([sys.executable, "-m", "train.export", "--drafter", "x", "--out", "y",
                         "--draft-vocab-size", "16"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2
  assert "--draft-vocab-size and --token-counts go together" in proc.stderr


# ------------------------------------------------------------ DSpark, Domino
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_heads_keep_weights_and_the_logits_of_the_kept_ids(tiny, heads, kind):
  full = heads[kind]
  restricted = with_draft_vocab(full, _counts(tiny.config.vocab_size), size=SIZE, target=tiny)
  assert type(restricted) is type(full)
  d2t = np.asarray(restricted.d2t[...])
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(full, nnx.Param)),
                               nnx.to_flat_state(nnx.state(restricted, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
  d = tiny.config.hidden_size
  h = jax.random.normal(jax.random.key(0), (2, 3, d))
  prev = jax.random.randint(jax.random.key(1), (2, 3), 0, tiny.config.vocab_size)
  got = np.asarray(_head_logits(restricted, h, prev))
  assert got.shape == (2, 3, SIZE)
  np.testing.assert_allclose(got, np.asarray(_head_logits(full, h, prev))[..., d2t], rtol=1e-5,
                             atol=1e-5)
  if kind == "domino":
    np.testing.assert_allclose(np.asarray(restricted.corrected_logits(h, prev)[0]),
                               np.asarray(full.corrected_logits(h, prev)[0])[..., d2t],
                               rtol=1e-5, atol=1e-5)

  # Drafting: the state holds the kept ids' rows of the head's output weight, and a
  # stage's drafts are the argmax over the kept ids of the teacher-forced logits
  # whose previous tokens are the anchor and the stage's own drafts, as target ids.
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 6), 0, tiny.config.vocab_size),
                      np.int32)
  features = np.asarray(jax.random.normal(jax.random.key(3), (2, 6, len(full.taps), d)))
  state = draft_training.commit_prefix(restricted, tokens, features, 5, capacity=16)
  rows = state.markov_rows if kind == "dspark" else state.correction_rows
  assert state.head_rows.shape == (SIZE, d) and rows.shape == (SIZE, 8)
  _, h = restricted.backbone_stage(state, 3)
  _, drafted = draft_training.draft_stage(restricted, state, jax.random.key(0), block_size=3,
                                          sampling=SamplingConfig())
  drafts = np.asarray(drafted.tokens)
  assert np.isin(drafts, d2t).all()
  prev = np.concatenate([tokens[:, 5:6], drafts[:, :-1]], axis=1)
  logits = _head_logits(restricted, h, jnp.asarray(prev), state)
  np.testing.assert_array_equal(drafts, d2t[np.asarray(jnp.argmax(logits, -1))])
  np.testing.assert_allclose(drafted.logprobs, np.take_along_axis(
      np.asarray(jax.nn.log_softmax(logits)), np.asarray(jnp.argmax(logits, -1))[..., None],
      -1)[..., 0], atol=1e-5)
  if kind == "domino":
    # DARTree: candidates are target ids of the kept vocabulary; slot 0 is the chain.
    _, ts = nnx.jit(lambda d, s: d.draft_tree_stage(s, block_size=3, budget=4))(restricted, state)
    cands = ts.candidates
    assert ts.vocab is None
    np.testing.assert_array_equal(np.asarray(cands.tokens)[:, :, 0], drafts)
    assert np.isin(np.asarray(cands.tokens)[np.isfinite(np.asarray(cands.scores))], d2t).all()


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_restricted_heads_are_lossless(tiny, heads, kind):
  restricted = with_draft_vocab(heads[kind], _counts(tiny.config.vocab_size, 1), size=SIZE,
                                target=tiny)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 64, size=int(rng.integers(2, 10))).tolist() for _ in range(3)]
  ar = generate(tiny, prompts, max_new_tokens=12)
  runs = [dict(mode="sd"), dict(mode="dloop", gate=-jnp.inf)]
  if kind == "domino":
    # DARTree: candidates are target ids (the GRU reads them).
    runs += [dict(run, tree_budget=4) for run in runs]
  for run in runs:
    out = generate(tiny, prompts, max_new_tokens=12, drafter=restricted, schedule="off",
                   max_stages=2, **run)
    for p, want, got in zip(prompts, ar.tokens, out.tokens):
      assert_same_or_near_tie(tiny, p, want, got)
    assert out.total.accepted > 0, run


def test_restricted_dspark_samples_the_target_distribution(tiny, heads):
  """The first three tokens follow the target's distribution.

  Drafts are drawn from, and verified against, the Markov head's distribution
  over the kept ids, scattered into the target vocabulary.
  """
  restricted = with_draft_vocab(heads["dspark"], _counts(tiny.config.vocab_size), size=SIZE,
                                target=tiny)
  sampling = SamplingConfig(temperature=1.0, top_k=4)
  prompt = [3, 14, 15]
  out = generate(tiny, [prompt] * 2000, max_new_tokens=3, mode="dloop", drafter=restricted,
                 block_size=2, gate=-jnp.inf, max_stages=2, sampling=sampling, seed=12,
                 schedule="off")
  exact = reference.exact_distribution(tiny, prompt, sampling, depth=3)
  assert reference.chi_square_pvalue([tuple(t[:3]) for t in out.tokens], exact)[0] > 1e-3
  assert out.total.accepted > 0


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_heads_restricted_written_in_public_layouts_over_the_whole_head(tiny, kind, tmp_path):
  """No public layout holds a draft vocabulary: a restricted DSpark / Domino drafter is written
  with a warning as the full-vocabulary drafter, whose weights it has unchanged."""
  # Taps before the last layer: public layouts read the last one after the final norm.
  full = build_drafter(dict(HEADS[kind], mask_token_id=3, taps=[0]), target=tiny,
                       rngs=nnx.Rngs(2))
  nnx.update(full, jax.tree.map(lambda x: x + 0.01, nnx.state(full, nnx.Param)))
  restricted = with_draft_vocab(full, _counts(tiny.config.vocab_size), size=SIZE, target=tiny)
  with pytest.warns(UserWarning, match="no draft vocabulary"):
    path = drafter_io.export_drafter(restricted, tmp_path / "hf", target_name="tiny",
                                     format="hf")
  loaded = drafter_io.load_drafter(path, target=tiny)
  assert not loaded.reduced_vocab
  want = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(full, nnx.Param))}
  got = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(loaded, nnx.Param))}
  assert sorted(want) == sorted(got)
  for p in want:
    np.testing.assert_allclose(got[p], want[p], rtol=1e-2, atol=1e-2, err_msg=str(p))


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_heads_restricted_are_not_trained(tiny, heads, kind):
  restricted = with_draft_vocab(heads[kind], _counts(tiny.config.vocab_size), size=SIZE,
                                target=tiny)
  # Trained over the full vocabulary, restricted afterwards: refused at the
  # trainer's config check and by the objective.
  c = config_lib.base_config()
  c.objective = kind
  c.drafter = dict(HEADS[kind], draft_vocab_size=SIZE)
  with pytest.raises(ConfigError, match="trains over the full vocabulary.*train.export"):
    config_lib.validate(c)
  with pytest.raises(ConfigError, match="trains over the full vocabulary"):
    objectives.loss_fn(restricted, {}, jax.random.key(0), objective=kind)
