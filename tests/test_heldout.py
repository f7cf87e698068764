"""The held-out metric: a split never trained on, and standard errors over examples."""

from __future__ import annotations

import numpy as np
import pytest

from dloop_jax.data import pipeline
from dloop_jax.errors import ConfigError
from dloop_jax.training import heldout


def _source(n: int, length: int = 6):
  return [{"tokens": np.full(length, i + 1, np.int32), "loss_mask": np.ones(length, np.int32),
           "features": np.zeros((length, 1, 2), np.float16)} for i in range(n)]


def test_heldout_examples_are_never_trained_on():
  src = _source(21)
  ds = pipeline.make_dataset(path="", source=src, seq_len=8, batch_size=2, seed=3,
                             shard_index=0, shard_count=1, num_epochs=1, heldout_examples=5)
  trained = {int(row[0]) - 1 for batch in ds for row in batch["tokens"]}
  assert trained == set(range(16))
  batches = pipeline.heldout_batches(path="", source=src, seq_len=8, batch_size=4,
                                     heldout_examples=5, features=False)
  assert [b["example"].tolist() for b in batches] == [[0, 1, 2, 3], [4, -1, -1, -1]]
  assert sorted(batches[0]) == sorted(pipeline.TOKEN_BATCH_KEYS + ("example",))
  held = [int(t[0]) - 1 for b in batches for t, e in zip(b["tokens"], b["example"]) if e >= 0]
  assert held == [16, 17, 18, 19, 20]
  assert not batches[1]["loss_mask"][1:].any()  # empty rows predict nothing
  # Two processes read their halves of each held-out batch.
  halves = [pipeline.heldout_batches(path="", source=src, seq_len=8, batch_size=4,
                                     heldout_examples=5, shard_index=i, shard_count=2)
            for i in range(2)]
  assert [h[0]["example"].tolist() for h in halves] == [[0, 1], [2, 3]]
  with pytest.raises(ConfigError, match="leave some to train on"):
    pipeline.make_dataset(path="", source=src, seq_len=8, batch_size=2, heldout_examples=21)
  with pytest.raises(ConfigError, match="besides the held-out"):
    pipeline.make_dataset(path="", source=src, seq_len=8, batch_size=2, heldout_examples=5,
                          max_examples=17)


def test_standard_errors_are_those_of_the_mean_over_examples():
  rng = np.random.default_rng(0)
  n = 200
  hits = (rng.random((n, 1)) < 0.3).astype(np.int64)
  out = heldout.summarize(hits, np.ones_like(hits))
  p = hits.mean()
  # One prediction per example: the jackknife SE of the pooled accuracy is
  # the usual SE of a mean, s / sqrt(n).
  assert out["heldout_acc_1"] == pytest.approx(p)
  assert out["heldout_acc_1_se"] == pytest.approx(hits.std(ddof=1) / np.sqrt(n), rel=1e-9)
  assert out["heldout_tau"] == pytest.approx(1 + p)
  assert out["heldout_tau_se"] == pytest.approx(out["heldout_acc_1_se"], rel=1e-9)
  assert out["heldout_examples"] == n


def test_tau_and_its_error_shrink_with_examples():
  rng = np.random.default_rng(1)

  def sample(n):
    counted = rng.integers(1, 9, (n, 3))
    correct = rng.binomial(counted, [0.8, 0.6, 0.5])
    return heldout.summarize(correct, counted)

  small, large = sample(40), sample(4000)
  assert large["heldout_tau_se"] < small["heldout_tau_se"] / 5
  want = 1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5
  assert abs(large["heldout_tau"] - want) < 4 * large["heldout_tau_se"]
  # Examples with nothing to predict (empty rows) are left out.
  out = heldout.summarize(np.array([[1, 0], [0, 0]]), np.array([[1, 1], [0, 0]]))
  assert out["heldout_examples"] == 1 and np.isnan(out["heldout_tau_se"])
