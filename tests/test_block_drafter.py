"""Block (DFlash-style) drafter: engine losslessness, train / inference agreement, errors."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import draft_training
import reference
from dloop_jax.decoding import SamplingConfig, engine, generate
from dloop_jax.drafters import BlockDrafter, Frozen, build_drafter, default_drafter_config
from dloop_jax.errors import ConfigError, DrafterMismatchError
from dloop_jax.models.transformer import tiny_target
from lossless import assert_same_or_near_tie

BLOCK = 4
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def examples(tiny):
  return draft_training.make_examples(tiny, taps=(0, 1), num_prompts=64, max_new_tokens=40,
                                      seed=0)


@pytest.fixture(scope="module")
def drafters(tiny, examples):
  batches = [draft_training.pack_batch(examples[i:i + 16], seq_len=48)
             for i in range(0, len(examples), 16)]
  config = {"kind": "block", "block_size": BLOCK, "num_layers": 2}
  untrained = build_drafter(config, target=tiny, rngs=nnx.Rngs(0))
  trained = build_drafter(config, target=tiny, rngs=nnx.Rngs(0))
  draft_training.train(trained, batches, objective="block", cfg={"anchors_per_sequence": 8},
                       steps=80)
  return {"untrained": untrained, "trained": trained}


def _prompts(rng, batch):
  return [rng.integers(0, 64, size=int(rng.integers(2, 12))).tolist() for _ in range(batch)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless(tiny, drafters, batch):
  rng = np.random.default_rng(10 + batch)
  prompts = _prompts(rng, batch)
  max_new = 17
  ar = generate(tiny, prompts, max_new_tokens=max_new)
  runs = [("sd", 3, 1, -0.5)] + [("dloop", 2, 3, g) for g in (-math.inf, -1.0, math.inf)]
  for drafter in drafters.values():
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


def test_trained_drafter_accepts_more(tiny, drafters):
  prompts = _prompts(np.random.default_rng(5), 3)
  taus = {n: generate(tiny, prompts, max_new_tokens=17, mode="sd", drafter=d,
                      block_size=3, schedule="off", lookup="off").total.acceptance_length
          for n, d in drafters.items()}
  assert taus["trained"] > taus["untrained"], taus


@pytest.mark.parametrize("mode", ["sd", "dloop"])
def test_sampling_first_two_tokens(tiny, drafters, mode):
  sampling = SamplingConfig(temperature=1.0, top_k=6)
  prompt = [3, 14, 15]
  n = 3000
  out = generate(tiny, [prompt] * n, max_new_tokens=2, mode=mode, drafter=drafters["trained"],
                 block_size=2, gate=-math.inf, max_stages=2, sampling=sampling, seed=12)
  samples = [tuple(t[:2]) for t in out.tokens]
  exact = reference.exact_distribution(tiny, prompt, sampling, depth=2)
  assert reference.chi_square_pvalue(samples, exact)[0] > 1e-3


def _stage_predictions(drafter, h, head_rows):
  logits = drafter.draft_logits(h, head_rows=head_rows)
  return np.asarray(jnp.argmax(logits, -1)), np.asarray(
      jnp.max(jax.nn.log_softmax(logits), axis=-1))


def test_train_stages_match_inference(examples, drafters):
  """Stage 1 and a teacher-forced stage 2 (stand-in context) agree with train_stages."""
  # Exactly, with the layers read in their own dtype while drafting; the default
  # bf16 drafting layers (`block.DRAFT_LAYER_DTYPE`) are checked after.
  drafter = nnx.clone(drafters["trained"])
  drafter.draft_layer_dtype = None
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  n, gamma = 10, 3
  hs = nnx.jit(lambda d, b: d.train_stages(
      tokens=b["tokens"], features=b["features"], positions=b["positions"],
      segment_ids=b["segment_ids"], anchors=jnp.full((2, 1), n, jnp.int32), block_size=gamma,
      num_stages=2))(drafter, jax.tree.map(jnp.asarray, batch))
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], n)
  state, first = draft_training.draft_stage(drafter, state, jax.random.key(0), block_size=gamma,
                                            sampling=GREEDY)
  # Inference reads the head in bf16 (`block.DRAFT_HEAD_DTYPE`); the same head
  # over the training path's outputs gives the same drafts and log-probabilities.
  assert state.head_rows.dtype == jnp.bfloat16
  tokens, logprobs = _stage_predictions(drafter, hs[0][:, 0], state.head_rows)
  np.testing.assert_array_equal(first.tokens, tokens)
  np.testing.assert_allclose(first.logprobs, logprobs, atol=1e-5)
  _, f32_logprobs = _stage_predictions(drafter, hs[0][:, 0], None)
  np.testing.assert_allclose(first.logprobs, f32_logprobs, atol=0.05)
  # Stage 2 anchored at the ground-truth token (training uses ground-truth inputs).
  state = state.replace(anchor=jnp.asarray(batch["tokens"][:, n + gamma]))
  _, second = draft_training.draft_stage(drafter, state, jax.random.key(0), block_size=gamma,
                                         sampling=GREEDY)
  tokens, logprobs = _stage_predictions(drafter, hs[1][:, 0], state.head_rows)
  np.testing.assert_array_equal(second.tokens, tokens)
  np.testing.assert_allclose(second.logprobs, logprobs, atol=1e-5)


def test_drafting_reads_bf16_layers_sliced_once(tiny, examples, drafters):
  """Drafting's layer matrices: bf16 copies made once per generation, outside the loops."""
  drafter = drafters["trained"]
  assert drafter.draft_layer_dtype == jnp.bfloat16
  state = drafter.init_state(batch_size=1, capacity=8)
  assert len(state.layers) == 2
  for i, layer in enumerate(state.layers):
    assert layer["w_gate_up"].dtype == jnp.bfloat16 and layer["wo"].dtype == jnp.bfloat16
    assert layer["attn_norm"].dtype == drafter.attn_norm[...].dtype  # norms keep theirs
    # Held out-major ([N, K], as the bf16 target's layers).
    np.testing.assert_array_equal(np.asarray(layer["w_down"], np.float32),
                                  np.asarray(drafter.w_down[...][i].T.astype(jnp.bfloat16),
                                             np.float32))
  assert drafter.drafts_out_major
  # Drafts close to those of the layers' own (f32) dtype.
  exact = nnx.clone(drafter)
  exact.draft_layer_dtype = None
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  stages = []
  for d in (drafter, exact):
    st = draft_training.commit_prefix(d, batch["tokens"], batch["features"], 10)
    stages.append(draft_training.draft_stage(d, st, jax.random.key(0), block_size=3,
                                             sampling=GREEDY)[1])
  np.testing.assert_allclose(stages[0].logprobs, stages[1].logprobs, atol=0.05)
  # In the compiled generation, no loop body materializes a layer's matrix: the
  # per-layer copies are made before the loops (XLA does not hoist slices).
  generate(tiny, [[3, 1, 4, 1, 5]], max_new_tokens=9, mode="sd", drafter=drafter,
           block_size=3, schedule="off")
  _, d, inner = drafter.w_gate_up[...].shape
  per_layer = re.compile(rf"= (f32|bf16)\[({d},{inner}|{inner},{d})\]\{{[0-9,]*\}} \S+\(")
  programs = [c.as_text() for c in engine._COMPILED.values()]
  programs = [t for t in programs if f"[2,{d},{inner}]" in t]
  assert programs
  materialized = []
  for text in programs:
    header = ""
    for line in text.splitlines():
      if line and not line.startswith(" "):
        header = line.split("(")[0]
      elif ("ENTRY" not in header and "_computation" not in header and per_layer.search(line)
            and not re.search(r"(parameter|get-tuple-element|tuple)\(", line)):
        materialized.append(line.strip()[:160])
  assert not materialized, materialized[:3]


def test_commit_rolls_back_stand_ins(examples, drafters):
  drafter = drafters["trained"]
  batch = draft_training.pack_batch(examples[:3], seq_len=32)
  tokens, features = batch["tokens"], batch["features"]
  n = 9
  key = jax.random.key(1)
  state = draft_training.commit_prefix(drafter, tokens, features, n)
  for _ in range(2):
    state, _ = draft_training.draft_stage(drafter, state, key, block_size=3, sampling=GREEDY)
  assert np.all(np.asarray(state.lengths) == n + 6)
  counts = np.array([1, 4, 7], np.int32)
  nxt = np.concatenate([tokens[:, 1:], np.zeros((3, 1), np.int32)], axis=1)
  w = 7
  after = draft_training.commit(drafter, state, jnp.asarray(tokens[:, n:n + w]),
                                jnp.asarray(features[:, n:n + w]), jnp.asarray(nxt[:, n:n + w]),
                                jnp.full((3,), n, jnp.int32), jnp.asarray(counts))
  np.testing.assert_array_equal(after.lengths, n + counts)
  np.testing.assert_array_equal(after.anchor, tokens[np.arange(3), n + counts])
  for r in range(3):
    fresh = draft_training.commit_prefix(drafter, tokens[r:r + 1], features[r:r + 1],
                                         n + int(counts[r]))
    _, want = draft_training.draft_stage(drafter, fresh, key, block_size=4, sampling=GREEDY)
    row = after.replace(k=after.k[:, r:r + 1], v=after.v[:, r:r + 1],
                        lengths=after.lengths[r:r + 1], anchor=after.anchor[r:r + 1],
                        committed_anchor=after.committed_anchor[r:r + 1])
    _, got = draft_training.draft_stage(drafter, row, key, block_size=4, sampling=GREEDY)
    np.testing.assert_array_equal(want.tokens, got.tokens)
    np.testing.assert_allclose(want.logprobs, got.logprobs, atol=1e-5)


def test_reduced_vocabulary(tiny, examples):
  drafter = build_drafter({"kind": "block", "block_size": BLOCK, "draft_vocab_size": 40},
                          target=tiny, rngs=nnx.Rngs(0))
  batch = draft_training.pack_batch(examples[:2], seq_len=32)
  state = draft_training.commit_prefix(drafter, batch["tokens"], batch["features"], 8)
  _, stage = draft_training.draft_stage(drafter, state, jax.random.key(2), block_size=3,
                                        sampling=SamplingConfig(temperature=1.0))
  d2t = np.asarray(drafter.d2t[...])
  assert np.all(np.isin(np.asarray(stage.tokens), d2t))
  np.testing.assert_allclose(np.asarray(stage.probs).sum(-1), 1.0, atol=1e-5)
  assert np.all(np.asarray(stage.probs)[..., np.setdiff1d(np.arange(64), d2t)] == 0)


def test_config_round_trip_and_frozen_weights(tiny):
  drafter = build_drafter({"kind": "block", "block_size": 6}, target=tiny, rngs=nnx.Rngs(0))
  assert isinstance(drafter, BlockDrafter) and drafter.kind == "parallel"
  assert drafter.max_block_size() == 6
  config = json.loads(json.dumps(drafter.drafter_config()))
  assert build_drafter(config, target=tiny, rngs=nnx.Rngs(1)).drafter_config() == config
  frozen = {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(drafter, Frozen))}
  assert frozen == ({"embed"} if tiny.lm_head is None else {"embed", "lm_head"})
  params = {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}
  assert not params & frozen and "mask_embed" in params
  assert "mask_token_id" not in config  # configs of learned-mask drafters are as before
  # DFlash's mask: the frozen embedding of a token, no mask parameter.
  tied = build_drafter({"kind": "block", "mask_token_id": 5}, target=tiny, rngs=nnx.Rngs(0))
  config = json.loads(json.dumps(tied.drafter_config()))
  assert config["mask_token_id"] == 5
  assert build_drafter(config, target=tiny, rngs=nnx.Rngs(1)).spec == tied.spec
  assert "mask_embed" not in {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(tied, nnx.Param))}
  x = np.asarray(tied.block_inputs(jnp.array([7, 9]), 3))  # [2, 1 + 3, D]
  embed = np.asarray(tiny.embed[...])
  np.testing.assert_array_equal(x[:, 0], embed[[7, 9]])
  np.testing.assert_array_equal(x[:, 1:], np.broadcast_to(embed[5], (2, 3, embed.shape[1])))
  for bad, match in (({"kind": "block", "mask_token_id": 10_000}, "mask_token_id must be"),
                     ({"kind": "eagle3", "mask_token_id": 5}, "block family")):
    with pytest.raises(ConfigError, match=match):
      build_drafter(bad, target=tiny, rngs=nnx.Rngs(0))
  big = default_drafter_config("block", tiny_target(seed=0, num_layers=30).config)
  assert big["num_layers"] == 3 and big["block_size"] == 8
  with pytest.raises(ConfigError, match="exceeds"):
    generate(tiny, [[1, 2]], max_new_tokens=4, mode="sd", drafter=drafter, block_size=7)


def test_target_mismatch_raises(tiny):
  drafter = build_drafter({"kind": "block"}, target=tiny, rngs=nnx.Rngs(0))
  with pytest.raises(DrafterMismatchError, match="vocab_size"):
    generate(tiny_target(seed=1, vocab_size=80), [[1, 2, 3]], max_new_tokens=4, mode="dloop",
             drafter=drafter, block_size=2)


def test_default_sizing_for_the_real_target():
  """One forward drafts a block of 8 reading under a third of a target forward's weights."""
  config = draft_training.smollm2_shaped_config()
  d = draft_training.abstract_drafter({"kind": "block"}, config)
  assert d.drafter_config()["num_layers"] == 3 and d.block_size == 8
  layers = draft_training.num_weights(d.wqkv, d.wo, d.w_gate_up, d.w_down)
  head = draft_training.num_weights(d.embed)  # tied: the head is the embedding
  assert (layers + head) / config.num_params() < 0.35
