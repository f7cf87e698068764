"""The per-width cost table: interpolation, files, calibration, the on-disk cache, overrides."""

from __future__ import annotations

import json

import numpy as np
import pytest

import drafter_fixtures
from dloop_jax.decoding import costs as costs_lib
from dloop_jax.decoding import generate
from dloop_jax.errors import ConfigError

CPU = {1: 30.0, 2: 40.4, 5: 51.7, 9: 63.6, 13: 66.8}


def test_interpolates_between_measured_widths():
  table = costs_lib.CostTable(costs={"13": 66.8, 1: 30.0, 5: 51.7, 2: 40.4, 9: 63.6})
  assert table.widths == (1, 2, 5, 9, 13)
  np.testing.assert_allclose(table.at([1, 3, 4, 7, 13]),
                             [30.0, 40.4 + (51.7 - 40.4) / 3, 40.4 + 2 * (51.7 - 40.4) / 3,
                              (51.7 + 63.6) / 2, 66.8], rtol=1e-6)
  assert "    5    51.70  1.72" in table.format()


@pytest.mark.parametrize("costs,match", [
    ({}, "at least one"),
    ({0: 1.0}, "widths must be integers >= 1, got 0"),
    ({"two": 1.0}, "widths must be integers >= 1, got 'two'"),
    ({1.5: 1.0}, "widths must be integers >= 1, got 1.5"),
    ({1: -3.0}, "entry for width 1 must be a positive finite number, got -3.0"),
    ({1: float("nan")}, "entry for width 1 must be a positive finite number"),
    ({1: "fast"}, "entry for width 1 must be a positive finite number, got 'fast'"),
])
def test_bad_tables(costs, match):
  with pytest.raises(ConfigError, match=match):
    costs_lib.CostTable(costs=costs)


def test_widths_missing():
  table = costs_lib.CostTable(costs={2: 1.0, 9: 2.0})
  with pytest.raises(ConfigError, match=r"measures widths \[2, 9\] but not width 1"):
    table.at([1, 5])
  with pytest.raises(ConfigError, match=r"widths up to 5, but widths \[9, 13\] are verified"):
    costs_lib.CostTable(costs={1: 1.0, 5: 2.0}).at([1, 5, 9, 13])


def test_save_load_and_malformed_files(tmp_path):
  table = costs_lib.CostTable(costs=CPU, key={"batch_size": 1})
  path = table.save(tmp_path / "t.json")
  again = costs_lib.load(path)
  assert again.costs == table.costs and again.key == {"batch_size": 1}
  assert costs_lib.as_table(str(path)).costs == table.costs
  assert json.loads((tmp_path / "t.json").read_text())["unit"] == "ms"
  cases = {
      "missing.json": (None, "Cannot read cost table"),
      "text.json": ("width 1: 30 ms", "is not valid JSON"),
      "list.json": ("[30.0, 40.4]", r"needs a \"costs\" object"),
      "flat.json": ('{"1": 30.0}', r"needs a \"costs\" object"),
      "negative.json": ('{"costs": {"1": -30.0}}', "entry for width 1 must be a positive"),
  }
  for name, (text, match) in cases.items():
    if text is not None:
      (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
      costs_lib.load(tmp_path / name)
    assert name in str(err.value)


def test_calibration_is_cached_per_key_and_extended(tiny, tmp_path, monkeypatch):
  """First call measures and saves; later calls (and processes) read the file; a wider
  need is measured and added; another batch size is another table."""
  costs_lib._MEMO.clear()
  monkeypatch.setattr(costs_lib, "DEFAULT_WIDTHS", (1, 2, 5))  # fewer compiles
  calls = []
  real = costs_lib.calibrate

  def counting(target, **kw):
    calls.append(kw)
    return real(target, repeats=2, **{k: v for k, v in kw.items() if k != "repeats"})

  monkeypatch.setattr(costs_lib, "calibrate", counting)
  first = costs_lib.for_target(tiny, batch_size=1, directory=str(tmp_path))
  assert first.widths == (1, 2, 5) and len(calls) == 1
  assert all(c > 0 for c in first.costs.values())
  assert first.key["batch_size"] == 1 and first.key["weights"] == ["float32"]
  files = list((tmp_path / "costs").glob("*.json"))
  assert len(files) == 1
  costs_lib._MEMO.clear()  # as a new process: from the file
  assert costs_lib.for_target(tiny, batch_size=1, directory=str(tmp_path)).costs == first.costs
  assert len(calls) == 1
  wider = costs_lib.for_target(tiny, batch_size=1, widths=[9], directory=str(tmp_path))
  assert wider.widths == (1, 2, 5, 9) and len(calls) == 2
  assert {w: wider.costs[w] for w in first.widths} == first.costs
  assert costs_lib.load(files[0]).widths[-1] == 9
  other = costs_lib.for_target(tiny, batch_size=2, directory=str(tmp_path))
  assert other.key["batch_size"] == 2 and len(calls) == 3
  assert len(list((tmp_path / "costs").glob("*.json"))) == 2
  costs_lib.for_target(tiny, batch_size=2, directory=str(tmp_path), recalibrate=True)
  assert len(calls) == 4


def test_generate_measures_only_when_asked(tiny, tmp_path, monkeypatch):
  """costs=None, no $DLOOP_COSTS, nothing cached: the profile's default table, a warning, no
  file; costs="calibrate": the table is measured and cached, then costs=None reuses it."""
  costs_lib._MEMO.clear()
  monkeypatch.setattr(costs_lib, "DEFAULT_WIDTHS", (1, 2, 3))  # fewer compiles
  monkeypatch.delenv("DLOOP_COSTS")
  monkeypatch.setenv("DLOOP_CACHE_DIR", str(tmp_path))
  drafter = drafter_fixtures.perturbed(tiny, noise_scale=1.0, seed=3)
  kw = dict(max_new_tokens=6, mode="sd", drafter=drafter, block_size=1)
  ar = generate(tiny, [[1, 2, 3]], max_new_tokens=6)
  calls = []
  calibrate = costs_lib.calibrate
  monkeypatch.setattr(costs_lib, "calibrate", lambda *a, **k: calls.append(k) or calibrate(*a, **k))
  with pytest.warns(UserWarning, match="python -m infer.costs"):
    assert generate(tiny, [[1, 2, 3]], **kw).tokens == ar.tokens
  assert not calls and not (tmp_path / "costs").exists()
  assert generate(tiny, [[1, 2, 3]], costs="calibrate", **kw).tokens == ar.tokens
  (path,) = (tmp_path / "costs").glob("*.json")
  assert len(calls) == 1
  stamp = path.stat().st_mtime_ns
  costs_lib._MEMO.clear()
  assert generate(tiny, [[1, 2, 3]], **kw).tokens == ar.tokens
  assert path.stat().st_mtime_ns == stamp and len(calls) == 1
  # $DLOOP_COSTS names a file used instead; a broken one is an error, not a silent fallback.
  (tmp_path / "broken.json").write_text("{}")
  monkeypatch.setenv("DLOOP_COSTS", str(tmp_path / "broken.json"))
  with pytest.raises(ConfigError, match="broken.json needs a \"costs\" object"):
    generate(tiny, [[1, 2, 3]], **kw)
