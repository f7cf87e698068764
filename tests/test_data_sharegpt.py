"""The sharegpt TFDS builder: split by id hash, filters and their counts, no TensorFlow."""

from __future__ import annotations

import json
import sys

import pytest
import tensorflow_datasets as tfds

from dloop_jax.data import sharegpt

tfds.disable_progress_bar()


def _no_tensorflow() -> bool:
  return not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """The first 400 conversations of the packaged corpus."""
  return sharegpt.build_sharegpt(data_dir=str(tmp_path_factory.mktemp("sg")),
                                 max_conversations=400)


def test_builds_and_reads_back_without_tensorflow(built):
  source = built.as_data_source()
  assert set(source) == {"train", "heldout"}
  ex = source["train"][0]
  assert set(ex) == {"index", "id", "group", "turns", "first_user_message", "starts_with_user"}
  assert ex["first_user_message"].strip()
  roles = {r.decode() for r in ex["turns"]["role"]}
  assert roles <= {"user", "assistant", "system", "other"}
  assert _no_tensorflow()


def test_heldout_never_in_train(built):
  source = built.as_data_source()
  train = [source["train"][i] for i in range(len(source["train"]))]
  heldout = [source["heldout"][i] for i in range(len(source["heldout"]))]
  assert heldout, "400 conversations should give a few held-out ones at 2 %"
  train_ids = {r["id"] for r in train}
  train_groups = {r["group"] for r in train}
  for r in heldout:
    assert r["id"] not in train_ids
    # All parts of a conversation share its split.
    assert r["group"] not in train_groups
    assert sharegpt.is_heldout(r["id"].decode(), fraction=0.02)
  assert not any(sharegpt.is_heldout(r["id"].decode(), fraction=0.02) for r in train)
  # Keys are file positions: unique, and all kept conversations are there.
  meta = built.info.metadata
  indices = [int(r["index"]) for r in train + heldout]
  assert len(set(indices)) == len(indices) == meta["kept"]["train"] + meta["kept"]["heldout"]
  assert len(indices) + sum(meta["dropped"].values()) == 400


def test_split_fraction_and_determinism():
  ids = [f"conv{i:05d}_{i % 3}" for i in range(20000)]
  frac = sum(sharegpt.is_heldout(i, fraction=0.02) for i in ids) / len(ids)
  assert 0.015 < frac < 0.025
  assert sharegpt.is_heldout("abc_0", fraction=0.5) == sharegpt.is_heldout("abc_7", fraction=0.5)


def test_filters_counts_and_truncated_file(tmp_path):
  convs = [
      {"id": "a_0", "conversations": [{"from": "human", "value": "hello"},
                                      {"from": "gpt", "value": "hi"}]},
      {"id": "b_0", "conversations": []},  # no user message
      {"id": "c_0", "conversations": [{"from": "human", "value": "   "}]},  # empty
      {"id": "d_0", "conversations": [{"from": "human", "value": "x" * 50}]},  # over-long
      {"id": "e_1", "conversations": [{"from": "gpt", "value": "...continued"},
                                      {"from": "human", "value": "go on"}]},
      {"id": "a_0", "conversations": [{"from": "human", "value": "same id again"}]},
  ]
  text = json.dumps(convs, indent=1)
  # Cut the file inside one more conversation, as the packaged file is cut.
  text = text[:-2] + ',\n {"id": "f_0", "conversations": [{"from": "human", "val'
  path = tmp_path / "sg.json"
  path.write_text(text)
  b = sharegpt.build_sharegpt(data_dir=str(tmp_path / "data"), source_path=str(path),
                              max_prompt_chars=20, heldout_fraction=0.0)
  meta = b.info.metadata
  assert meta["dropped"] == {"empty_prompt": 2, "overlong_prompt": 1, "truncated": 1}
  rows = sorted((int(r["index"]), r) for r in b.as_data_source()["train"])
  assert [i for i, _ in rows] == [0, 4, 5]
  by_index = dict(rows)
  assert by_index[4]["first_user_message"] == b"go on"
  assert not by_index[4]["starts_with_user"] and by_index[0]["starts_with_user"]
  assert "heldout" not in b.info.splits  # TFDS writes no empty split


def test_heldout_prompts(built):
  prompts = sharegpt.heldout_prompts(data_dir=str(built.data_dir_root), max_conversations=400)
  held = {r["id"].decode() for r in built.as_data_source()["heldout"]}
  assert prompts and {p["id"] for p in prompts} <= held
