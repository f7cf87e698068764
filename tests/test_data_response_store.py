"""Response stores: answers kept without features, and builds that compute the features from them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds

from dloop_jax.data import pipeline
from dloop_jax.data import response_store
from dloop_jax.data import target_responses as tr
from dloop_jax.data import target_responses_config as tr_config
from dloop_jax.errors import ConfigError

tfds.disable_progress_bar()

# Sampled answers: the seeds of the batches must carry over to the store.
BUILD = dict(target="tiny", target_seed=1, prompt_source="random", num_prompts=20,
             max_new_tokens=24, temperature=1.0, seed=5, batch_size=4, chunk_size=8)


def _builder(data_dir, *, store=None, **overrides):
  config = tr_config.make_config(**{**BUILD, **overrides})
  return tr.TargetResponses(data_dir=str(data_dir), config=config, file_format="array_record",
                            progress=False, responses_dir=None if store is None else str(store))


def _examples(builder):
  builder.download_and_prepare(download_config=tr.no_network_download_config())
  source = pipeline.data_source(builder.data_dir)
  return sorted((source[i] for i in range(len(source))), key=lambda e: int(e["index"]))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
  root = tmp_path_factory.mktemp("store")
  store = root / "answers"
  answered = _builder(root / "unused", store=store).answer_prompts()
  from_store = _builder(root / "from_store", store=store)
  captured = _builder(root / "captured")
  return answered, from_store, _examples(from_store), _examples(captured), store


def test_answers_only_writes_token_chunks_and_no_features(builds):
  answered, _, _, _, store = builds
  assert answered["chunks_total"] == 3 and answered["chunks_generated"] == 3
  assert answered["prompts"] == 20 and answered["new_tokens"] == 20 * 24
  chunks = sorted(n for n in os.listdir(answered["store_dir"]) if n.endswith(".npz"))
  assert chunks == ["chunk_00000.npz", "chunk_00001.npz", "chunk_00002.npz"]
  with np.load(os.path.join(answered["store_dir"], chunks[0])) as z:
    assert set(z.files) == set(response_store.ANSWER_KEYS)
  assert os.path.dirname(answered["store_dir"]) == str(store)


def test_features_from_stored_answers_equal_the_captured_build(builds):
  _, from_store, stored, captured, _ = builds
  assert from_store.chunks_from_store == 3 and from_store.chunks_generated == 0
  assert len(stored) == len(captured) == 20
  for a, b in zip(stored, captured):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    n = len(a["tokens"])
    # The same numbers up to summation order, stored in float16.
    np.testing.assert_allclose(a["features"][:n - 1].astype(np.float32),
                               b["features"][:n - 1].astype(np.float32), rtol=4e-3, atol=4e-3)
    assert not a["features"][n - 1].any()
  meta = from_store.info.metadata["totals"]
  assert meta["features_seconds"] > 0 and meta["new_tokens"] == 20 * 24


def test_answers_only_resumes_and_a_full_build_fills_the_store(tmp_path):
  store = tmp_path / "answers"
  first = _builder(tmp_path / "a", store=store, num_prompts=8).answer_prompts()
  assert first["chunks_generated"] == 1
  again = _builder(tmp_path / "a", store=store, num_prompts=8).answer_prompts()
  assert again["chunks_generated"] == 0 and again["chunks_reused"] == 1
  # A build that answers (no store entry for its settings yet) stores its answers too.
  builder = _builder(tmp_path / "b", store=store, num_prompts=12)
  _examples(builder)
  assert builder.chunks_generated == 2
  stores = [os.path.join(store, n) for n in os.listdir(store)]
  assert len(stores) == 2  # 8 and 12 prompts: two plans, two stores
  assert sorted(len([n for n in os.listdir(d) if n.endswith(".npz")]) for d in stores) == [1, 2]


def test_a_partly_answered_store_is_answered_first_then_read(builds, tmp_path):
  """The prompts the store lacks are answered (taps captured) before any stored answer is read."""
  # The chunk the build visits last (BUILD's seed orders chunks 1, 2, 0) is the one missing.
  order = np.random.default_rng(BUILD["seed"]).permutation(3).tolist()
  last = f"chunk_{order[-1]:05d}.npz"
  _, _, _, captured, store = builds
  partial = tmp_path / "answers"
  (done,) = os.listdir(store)
  shutil.copytree(store / done, partial / done, ignore=lambda folder, names: [last])
  builder = _builder(tmp_path / "build", store=partial)
  calls = []
  for name in ("_generate_chunk", "_features_chunk"):
    method = getattr(builder, name)
    def record(*args, _name=name, _method=method, **kwargs):
      calls.append(_name)
      return _method(*args, **kwargs)
    setattr(builder, name, record)
  examples = _examples(builder)
  assert calls == ["_generate_chunk", "_features_chunk", "_features_chunk"]
  assert builder.chunks_generated == 1 and builder.chunks_from_store == 2
  assert last in os.listdir(partial / done)  # the store is whole again
  assert [int(e["index"]) for e in examples] == list(range(20))
  for a, b in zip(examples, captured):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    n = len(a["tokens"])
    np.testing.assert_allclose(a["features"][:n - 1].astype(np.float32),
                               b["features"][:n - 1].astype(np.float32), rtol=4e-3, atol=4e-3)
  assert builder.info.metadata["totals"]["new_tokens"] == 20 * 24


def test_a_snapshot_skips_chunks_whose_features_are_not_computed(builds, tmp_path):
  """Stored answers without features are work left to the build, not part of its snapshot."""
  _, _, _, _, store = builds
  config = tr_config.make_config(**BUILD)
  work = tmp_path / "work"

  def builder(data_dir, config, **kw):
    return tr.TargetResponses(data_dir=str(data_dir), config=config, file_format="array_record",
                              progress=False, responses_dir=str(store), work_dir=str(work), **kw)

  _examples(builder(tmp_path / "full", config))
  # A build stopped after the features of chunk 0: the store answers all three.
  for name in ("chunk_00001.npz", "chunk_00002.npz"):
    os.remove(work / name)
  snap = builder(tmp_path / "snap", tr_config.snapshot_config(config), finished_chunks_only=True)
  snap._features_chunk = None  # pylint: disable=protected-access  (must not be called)
  examples = _examples(snap)
  assert sorted(int(e["index"]) for e in examples) == list(range(8))
  assert snap.chunks_from_store == 0 and snap.chunks_generated == 0
  assert snap.info.metadata["snapshot"]["missing_chunks"] == [1, 2]
  assert sorted(os.listdir(work)) == ["chunk_00000.npz"] + sorted(
      n for n in os.listdir(work) if not n.startswith("chunk_"))


def test_other_taps_reuse_the_answers(tmp_path):
  store = tmp_path / "answers"
  _builder(tmp_path / "a", store=store, num_prompts=8).answer_prompts()
  builder = _builder(tmp_path / "b", store=store, num_prompts=8, taps=(0,))
  examples = _examples(builder)
  assert builder.chunks_from_store == 1 and builder.chunks_generated == 0
  assert examples[0]["features"].shape[1] == 1


def test_a_store_of_another_plan_is_refused(tmp_path):
  store = tmp_path / "answers"
  answered = _builder(tmp_path / "a", store=store, num_prompts=8).answer_prompts()
  plan = os.path.join(answered["store_dir"], "plan.json")
  with open(plan) as f:
    text = f.read()
  with open(plan, "w") as f:
    f.write(text.replace('"prompts": "', '"prompts": "0'))
  with pytest.raises(ConfigError, match="holds answers of a different build"):
    _builder(tmp_path / "a", store=store, num_prompts=8).answer_prompts()


def test_answers_only_needs_a_store(tmp_path):
  with pytest.raises(ConfigError, match="needs a responses_dir"):
    _builder(tmp_path).answer_prompts()


def test_taps_only_forward_equals_the_full_forward():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import tiny_target  # pylint: disable=g-import-not-at-top
  model = tiny_target(seed=1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12)),
                       jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(12)[None], (2, 12))
  for taps in ((0,), (0, 1), (1, 0)):
    kw = dict(positions=positions, cache=model.init_cache(batch_size=2, capacity=12), taps=taps)
    full = model(tokens, **kw)
    only = model(tokens, taps_only=True, **kw)
    np.testing.assert_array_equal(np.asarray(only.taps), np.asarray(full.taps))
    assert only.logits.shape[1] == 0 and len(only.new_kv) == max(taps) + 1
  with pytest.raises(ValueError, match="taps_only needs taps"):
    model(tokens, taps_only=True, positions=positions,
          cache=model.init_cache(batch_size=2, capacity=12))


def test_the_repository_holds_answers_of_the_10k_recipe():
  """configs/data_smollm2.py:10k points at the answers shipped in data/responses."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "_data_smollm2", os.path.join(root, "configs", "data_smollm2.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("10k")
  assert config.responses_dir == os.path.join(root, "data", "responses")
  build_config = tr_config.config_from_data_config(config)
  name = response_store.store_name(target_slug="smollm2_135m_instruct", spec=build_config.spec())
  store_dir = os.path.join(config.responses_dir, name)
  with open(os.path.join(store_dir, "plan.json")) as f:
    plan = json.load(f)
  assert plan["config"] == response_store.answer_spec(build_config.spec())
  assert plan["target_name"] == "smollm2-135m-instruct"
  size = build_config.chunk_size
  chunks = sorted(n for n in os.listdir(store_dir) if n.endswith(".npz"))
  assert chunks, "no stored answers"
  for n in chunks:
    k = int(n[len("chunk_"):-len(".npz")])
    assert 0 <= k < -(-build_config.num_prompts // size)
    with np.load(os.path.join(store_dir, n)) as z:
      lengths, prompt_lens, tokens = z["lengths"], z["prompt_lens"], z["tokens"]
      assert z["index"].tolist() == list(range(k * size, k * size + len(lengths)))
      assert tokens.shape == (lengths.sum(),) and tokens.min() >= 0 and tokens.max() < 49152
      answer = lengths - prompt_lens
      assert (answer >= 1).all() and (answer <= build_config.max_new_tokens).all()
      assert (prompt_lens <= build_config.max_prompt_tokens).all()


def test_target_topk_from_stored_answers_through_the_pipeline_to_dspark(builds, tmp_path):
  """A `target_topk` build: the target's top-k next tokens, in batches, in DSpark's loss."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dloop_jax.drafters import build_drafter  # pylint: disable=g-import-not-at-top
  from dloop_jax.models.transformer import tiny_target  # pylint: disable=g-import-not-at-top
  from dloop_jax.training import objectives  # pylint: disable=g-import-not-at-top
  _, _, stored, _, store = builds
  k = 6
  builder = _builder(tmp_path / "topk", store=store, target_topk=k)
  examples = _examples(builder)
  assert builder.chunks_from_store == 3 and builder.chunks_generated == 0  # same answers
  model = tiny_target(seed=1)
  width = max(len(e["tokens"]) for e in examples)
  tokens = np.zeros((len(examples), width), np.int32)
  for i, e in enumerate(examples):
    tokens[i, :len(e["tokens"])] = e["tokens"]
  logits = nnx.jit(lambda m, t: m(t, positions=jnp.broadcast_to(jnp.arange(width), t.shape),
                                   cache=m.init_cache(batch_size=t.shape[0], capacity=width)
                                   ).logits)(model, jnp.asarray(tokens))
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  for i, (e, s) in enumerate(zip(examples, stored)):
    n = len(e["tokens"])
    np.testing.assert_array_equal(e["tokens"], s["tokens"])
    ids, p = e["target_topk_ids"], e["target_topk_probs"].astype(np.float32)
    assert ids.shape == p.shape == (n, k)
    assert not ids[n - 1].any() and not p[n - 1].any()
    np.testing.assert_allclose(p[:n - 1], np.take_along_axis(probs[i, :n - 1], ids[:n - 1], -1),
                               rtol=2e-3, atol=1e-4)
    assert (np.diff(p[:n - 1], axis=-1) <= 1e-3).all()  # descending
    # The k kept are the k likeliest (up to float16 ties at the boundary).
    kth = np.sort(probs[i, :n - 1], axis=-1)[:, -k]
    assert (p[:n - 1].min(-1) >= kth - 2e-3).all()
  # Both pipelines carry them; DSpark's objective uses them.
  for pack in (False, True):
    batch = next(pipeline.make_train_iterator(path=builder.data_dir, seq_len=48, batch_size=4,
                                              seed=0, shard_index=0, shard_count=1, pack=pack))
    assert batch["target_topk_ids"].shape == batch["target_topk_probs"].shape == (4, 48, k)
    assert batch["target_topk_probs"].dtype == np.float16
    np.testing.assert_array_equal(batch["target_topk_probs"][batch["segment_ids"] == 0], 0)
  drafter = build_drafter({"kind": "dspark", "block_size": 3, "markov_rank": 8},
                          target=model, rngs=nnx.Rngs(0))
  key = jax.random.key(0)
  loss = nnx.jit(lambda d, b, k: objectives.loss_fn(d, b, k, objective="dspark")[0])
  with_topk = loss(drafter, batch, key)
  one_hot = loss(drafter, {n: v for n, v in batch.items() if not n.startswith("target_topk")},
                 key)
  assert np.isfinite(float(with_topk)) and float(with_topk) != float(one_hot)
