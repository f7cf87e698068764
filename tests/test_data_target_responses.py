"""target_responses: regenerated responses and captured features, checked against the target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from dloop_jax.data import build_progress
from dloop_jax.data import pipeline
from dloop_jax.data import sharegpt
from dloop_jax.data import taps_forward
from dloop_jax.data import target_responses as tr
from dloop_jax.data import target_responses_config as tr_config
from dloop_jax.data import training_prompts
from dloop_jax.data.training_prompts import ShareGPTRecord
from dloop_jax.decoding import SamplingConfig, generate
from dloop_jax.errors import ConfigError
from dloop_jax.models.config import default_taps
from dloop_jax.models.transformer import tiny_target

tfds.disable_progress_bar()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 16 ShareGPT prompts (bytes-encoded: the tiny target has no tokenizer),
# answered by sampling so that the seed matters.
SHAREGPT_BUILD = dict(target="tiny", target_seed=1, prompt_source="sharegpt", num_prompts=16,
                      sharegpt_max_conversations=400, max_prompt_tokens=96, max_new_tokens=24,
                      temperature=1.0, seed=3, batch_size=4, chunk_size=8)


def _no_tensorflow() -> bool:
  return not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)


def _examples(dataset_dir):
  source = pipeline.data_source(dataset_dir)
  return sorted((source[i] for i in range(len(source))), key=lambda e: int(e["index"]))


@pytest.fixture(scope="module")
def sharegpt_build(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tr"))
  config = tr_config.make_config(**SHAREGPT_BUILD)
  builder = tr.TargetResponses(data_dir=data_dir, config=config, file_format="array_record",
                               progress=False)
  builder.download_and_prepare(download_config=tr.no_network_download_config())
  return builder, _examples(builder.data_dir)


def test_builds_and_reads_without_tensorflow(sharegpt_build):
  builder, examples = sharegpt_build
  assert len(examples) == 16
  assert [int(e["index"]) for e in examples] == list(range(16))
  meta = builder.info.metadata
  assert meta["taps"] == list(default_taps(2))
  assert meta["target_name"] == "tiny(seed=1,init_std=0.3)"
  assert meta["target_fingerprint"] == tiny_target(seed=1).config.fingerprint
  assert meta["totals"]["examples"] == 16
  assert _no_tensorflow()


def test_prompts_are_sharegpt_train_messages(sharegpt_build):
  builder, examples = sharegpt_build
  sg = sharegpt.build_sharegpt(data_dir=str(builder.data_dir_root), max_conversations=400)
  by_id = {r["id"].decode(): r for r in sg.as_data_source()["train"]}
  byte_tok = training_prompts.ByteTokenizer(64)
  for e in examples:
    record = by_id[e["prompt_key"].decode()]  # KeyError if not from the train split
    assert not sharegpt.is_heldout(e["prompt_key"].decode(), fraction=0.02)
    expected = training_prompts.encode_prompt(record["first_user_message"].decode(),
                                              tokenizer=byte_tok, chat_template=True)
    assert e["tokens"][:e["prompt_len"]].tolist() == expected
  # Sorted by length for less padding.
  lengths = [int(e["prompt_len"]) for e in examples]
  assert lengths == sorted(lengths)


def test_loss_mask_covers_exactly_the_response(sharegpt_build):
  _, examples = sharegpt_build
  for e in examples:
    n, p, r = len(e["tokens"]), int(e["prompt_len"]), int(e["response_len"])
    assert n == p + r and r >= 1
    assert e["loss_mask"].tolist() == [0] * p + [1] * r
    assert e["features"].shape == (n, 2, 32) and e["features"].dtype == np.float16


def test_responses_equal_generate_with_same_seed(sharegpt_build):
  _, examples = sharegpt_build
  model = tiny_target(seed=1)
  b = SHAREGPT_BUILD["batch_size"]
  sampling = SamplingConfig(temperature=SHAREGPT_BUILD["temperature"])
  for start in range(0, len(examples), b):
    batch = examples[start:start + b]
    prompts = [e["tokens"][:e["prompt_len"]].tolist() for e in batch]
    out = generate(model, prompts, max_new_tokens=SHAREGPT_BUILD["max_new_tokens"],
                   sampling=sampling, seed=tr.batch_key(SHAREGPT_BUILD["seed"], start // b))
    for e, response in zip(batch, out.tokens):
      assert e["tokens"][e["prompt_len"]:].tolist() == response


def test_features_equal_direct_forward(sharegpt_build):
  _, examples = sharegpt_build
  model = tiny_target(seed=1)
  taps = default_taps(2)
  width = 128
  tokens = np.zeros((len(examples), width), np.int32)
  for i, e in enumerate(examples):
    tokens[i, :len(e["tokens"])] = e["tokens"]

  @jax.jit
  def forward(tokens):
    cache = model.init_cache(batch_size=tokens.shape[0], capacity=width)
    positions = jnp.broadcast_to(jnp.arange(width)[None], tokens.shape)
    return model(tokens, positions=positions, cache=cache, taps=taps).taps

  direct = np.asarray(forward(jnp.asarray(tokens)))
  for i, e in enumerate(examples):
    n = len(e["tokens"])
    stored = e["features"].astype(np.float32)
    # Float16 storage: half-precision rounding of the same numbers.
    np.testing.assert_allclose(stored[:n - 1], direct[i, :n - 1], rtol=2e-3, atol=2e-3)
    assert not stored[n - 1].any()  # the last token is never read by the target
    assert np.abs(stored[:n - 1]).max() > 0.1


# Greedy, with a stop token: responses of several lengths, and a last partial
# batch filled with copies.
GREEDY_STOP = 9


@pytest.fixture(scope="module")
def greedy_build(tmp_path_factory):
  model = tiny_target(seed=1, eos_token_ids=(GREEDY_STOP,))
  config = tr_config.make_config(target="tiny_stop", prompt_source="random", num_prompts=10,
                                 max_new_tokens=20, batch_size=4, chunk_size=8, seed=7,
                                 random_prompt_min_len=2, random_prompt_max_len=30)
  builder = tr.TargetResponses(data_dir=str(tmp_path_factory.mktemp("greedy")), config=config,
                               file_format="array_record", progress=False, target_model=model)
  builder.download_and_prepare(download_config=tr.no_network_download_config())
  return model, _examples(builder.data_dir)


def test_greedy_build_equals_generate_ar_and_its_taps(greedy_build):
  # Tokens = greedy `generate(mode="ar")`; features = the taps the engine
  # computes for them, to float16 precision.
  model, examples = greedy_build
  taps = default_taps(2)
  assert len(examples) == 10
  stopped = [bool(e["stopped"]) for e in examples]
  assert any(stopped) and not all(stopped)
  for start in range(0, len(examples), 4):
    batch = examples[start:start + 4]
    out = generate(model, [e["tokens"][:e["prompt_len"]].tolist() for e in batch],
                   max_new_tokens=20, stop_tokens=(GREEDY_STOP,), capture_taps=taps)
    for e, response, captured in zip(batch, out.tokens, out.features):
      assert e["tokens"][e["prompt_len"]:].tolist() == response
      assert bool(e["stopped"]) == (response[-1] == GREEDY_STOP)
      n = len(e["tokens"])
      np.testing.assert_allclose(e["features"][:n - 1].astype(np.float32), captured,
                                 rtol=2e-3, atol=2e-3)
      assert not e["features"][n - 1].any()


def test_sharegpt_prompts_skip_repeats_and_heldout_texts():
  records = [
      ShareGPTRecord(key="a", text="Hello there", starts_with_user=True),
      ShareGPTRecord(key="b", text="  hello   THERE ", starts_with_user=True),  # repeat of a
      ShareGPTRecord(key="c", text="What is 2+2?", starts_with_user=True),
      ShareGPTRecord(key="d", text="continue", starts_with_user=False),
      ShareGPTRecord(key="e", text="Write a poem", starts_with_user=True),  # held out
      ShareGPTRecord(key="f", text="x" * 50, starts_with_user=True),  # too long
      ShareGPTRecord(key="g", text="Tell me a joke", starts_with_user=True),
  ]
  prompts, counts = training_prompts.select_sharegpt_prompts(
      records, heldout_texts=["write a  poem"], num_prompts=10, seed=0,
      skip_continuations=True, max_tokens=20, encode=lambda text: list(text.encode()))
  keys = sorted(p.key for p in prompts)
  assert len(keys) == 3 and "c" in keys and "g" in keys and keys[0] in ("a", "b")
  assert counts == {"examined": 7, "continuation": 1, "heldout_duplicate": 1, "duplicate": 1,
                    "overlong_tokens": 1}
  # A seed picks the same prompts, in the same order.
  again, _ = training_prompts.select_sharegpt_prompts(
      records, heldout_texts=["write a  poem"], num_prompts=10, seed=0,
      skip_continuations=True, max_tokens=20, encode=lambda text: list(text.encode()))
  assert again == prompts


def test_metadata_check_refuses_other_taps_or_target(sharegpt_build, tmp_path):
  builder, _ = sharegpt_build
  path = os.fspath(builder.data_dir)
  model = tiny_target(seed=1)
  pipeline.check_dataset_matches(path, taps=(0, 1), target_config=model.config,
                                 target_name="tiny(seed=1,init_std=0.3)")
  with pytest.raises(ConfigError, match=r"layers \(0, 1\).*reads layers \(1,\)"):
    pipeline.check_dataset_matches(path, taps=(1,))
  with pytest.raises(ConfigError, match="shape"):
    pipeline.check_dataset_matches(
        path, taps=(0, 1), target_fingerprint={**model.config.fingerprint, "hidden_size": 64})
  with pytest.raises(ConfigError, match="built with target"):
    pipeline.check_dataset_matches(path, taps=(0, 1), target_name="tiny(seed=2,init_std=0.3)")
  with pytest.raises(ConfigError, match="no finished"):
    pipeline.check_dataset_matches(str(tmp_path), taps=(0, 1))
  with pytest.raises(ConfigError, match="does not exist"):
    pipeline.check_dataset_matches(str(tmp_path / "nowhere"), taps=(0, 1))


def test_bad_options_are_config_errors():
  with pytest.raises(ConfigError, match="Unknown target_responses options"):
    tr_config.make_config(num_prompt=3)
  with pytest.raises(ConfigError, match="multiple of batch_size"):
    tr_config.make_config(batch_size=3, chunk_size=8)
  with pytest.raises(ConfigError, match="prompt_source"):
    tr_config.make_config(prompt_source="web")


# ------------------------------------------------------------------- resume
RESUME_BUILD = dict(target="tiny", target_seed=2, prompt_source="random", num_examples=24,
                    max_new_tokens=12, batch_size=4, chunk_size=4, seed=5,
                    random_prompt_max_len=8)

_CHILD = textwrap.dedent("""
    import json, sys, time
    from dloop_jax.data import target_responses as tr
    args = json.loads(sys.argv[2])
    def on_chunk(k, n, reused):
      if k == 1:  # two chunks saved: wait here to be killed
        print("PARKED", flush=True)
        time.sleep(600)
    tr.build_target_responses(out_dir=sys.argv[1], progress=False, on_chunk=on_chunk, **args)
""")


def test_killed_build_resumes_with_finished_chunks(tmp_path):
  out_dir = str(tmp_path / "killed")
  # The child's chunks are compared bit for bit with this process's: same XLA flags.
  env = dict(os.environ, XLA_FLAGS=os.environ["DLOOP_TEST_XLA_FLAGS"])
  child = subprocess.Popen([sys.executable, "-c", _CHILD, out_dir, json.dumps(RESUME_BUILD)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=env)
  try:
    # Blocks until the child parks (or dies: then stdout ends).
    lines = iter(child.stdout.readline, "")
    assert any(line.strip() == "PARKED" for line in lines), "the child died before two chunks"
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  work = [p for p in tmp_path.rglob("chunk_*.npz")]
  assert len(work) == 2
  mtimes = {p.name: p.stat().st_mtime_ns for p in work}
  assert not any(tmp_path.rglob("dataset_info.json"))  # nothing finished

  # A snapshot of the killed build: its two finished chunks, nothing generated.
  snap = tr.build_target_responses(out_dir=out_dir, progress=False, snapshot=True,
                                   **RESUME_BUILD)
  assert snap.chunks_generated == 0 and snap.config.name.endswith("_snapshot")
  assert len(_examples(snap.dataset_dir)) == 8
  assert snap.metadata["snapshot"]["chunks_used"] == 2
  assert len(snap.metadata["snapshot"]["missing_chunks"]) == 4

  seen = []
  result = tr.build_target_responses(
      out_dir=out_dir, progress=False, keep_work_dir=True,
      on_chunk=lambda k, n, reused: seen.append((k, reused)), **RESUME_BUILD)
  assert (result.chunks_reused, result.chunks_generated) == (2, 4)
  assert seen[:2] == [(0, True), (1, True)] and all(not r for _, r in seen[2:])
  for p in work:  # reused, not rewritten
    assert p.stat().st_mtime_ns == mtimes[p.name]

  fresh = tr.build_target_responses(out_dir=str(tmp_path / "fresh"), progress=False,
                                    **RESUME_BUILD)
  assert fresh.chunks_generated == 6
  a, b = _examples(result.dataset_dir), _examples(fresh.dataset_dir)
  assert len(a) == len(b) == 24
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
    np.testing.assert_array_equal(x["features"], y["features"])
  # The default removes the work directory after a finished build.
  assert not any((tmp_path / "fresh").rglob("chunk_*.npz"))
  # A finished dataset is reused as is.
  again = tr.build_target_responses(out_dir=out_dir, progress=False, **RESUME_BUILD)
  assert (again.chunks_generated, again.chunks_reused) == (0, 0)


def test_progress_line_has_rate_and_eta():
  import io
  stream = io.StringIO()
  p = build_progress.Progress(total=10, done=0, stream=stream, every_seconds=0.0)
  time.sleep(0.01)
  p.update(prompts=4, new_tokens=100)
  line = stream.getvalue()
  assert "4/10 prompts" in line and "new tok/s" in line and "ETA" in line
  assert "stored answers read" not in line
  p.update(prompts=2, new_tokens=0, read_tokens=500)
  assert "6/10 prompts" in stream.getvalue() and "tok/s of stored answers read" in stream.getvalue()


def test_out_of_range_features_are_clipped_and_counted(tmp_path, monkeypatch):
  monkeypatch.setattr(taps_forward, "F16_MAX", 0.5)
  result = tr.build_target_responses(out_dir=str(tmp_path), target="tiny", num_examples=4,
                                     max_new_tokens=4, batch_size=4, progress=False)
  assert result.metadata["totals"]["features_clipped"] > 0
  for e in _examples(result.dataset_dir):
    assert np.abs(e["features"].astype(np.float32)).max() <= 0.5


def test_work_dir_of_another_build_is_refused(tmp_path):
  work = str(tmp_path / "work")
  args = dict(target="tiny", num_examples=4, max_new_tokens=4, batch_size=4, progress=False,
              work_dir=work, keep_work_dir=True)
  tr.build_target_responses(out_dir=str(tmp_path / "a"), seed=0, **args)
  with pytest.raises(ConfigError, match="different build"):
    tr.build_target_responses(out_dir=str(tmp_path / "b"), seed=1, **args)
