"""The data-scaling curve from a benchmark's rows (infer.bench.scaling)."""

import json
import math

import pytest

from infer.bench import report, scaling


def _row(drafter, method, tau, *, multi=None, category=report.OVERALL):
  return dict(category=category, method=method, drafter=drafter, prompts=6,
              acceptance_length=tau, multi_stage_fraction=multi, identical_to_ar=1.0)


def _rows(a=1.1, b=0.2):
  rows = [_row("", "ar", 1.0)]
  for n in (1000, 3000, 10000):
    tau = a + b * math.log10(n)
    rows += [_row(f"block_{n}", "sd/all", tau), _row(f"block_{n}", "dloop/all", tau + 0.1, multi=0.2),
             _row(f"block_{n}", "sd/all", 9.0, category="math")]
  return rows


def test_fit_recovers_a_log_linear_law():
  a, b = scaling.fit_log_linear([(n, 0.7 + 0.3 * math.log10(n)) for n in (500, 2000, 9000)])
  assert a == pytest.approx(0.7) and b == pytest.approx(0.3)
  with pytest.raises(ValueError, match="two data sizes"):
    scaling.fit_log_linear([(1000, 1.2), (1000, 1.3)])


def test_curve_takes_overall_chain_rows_of_the_named_drafters():
  examples = {f"block_{n}": n for n in (1000, 3000, 10000)}
  points = scaling.curve(_rows(), examples)
  assert [(p["method"], p["examples"]) for p in points] == [
      ("dloop/all", 1000), ("dloop/all", 3000), ("dloop/all", 10000),
      ("sd/all", 1000), ("sd/all", 3000), ("sd/all", 10000)]
  assert {p["kind"] for p in points} == {"block"}
  fitted = scaling.fits(points)
  assert fitted[("block", "sd/all")] == pytest.approx((1.1, 0.2))
  assert fitted[("block", "dloop/all")] == pytest.approx((1.2, 0.2))
  with pytest.raises(ValueError, match=r"block_30000"):
    scaling.curve(_rows(), {**examples, "block_30000": 30000})


def test_main_writes_the_table_and_plot(tmp_path, capsys):
  results = tmp_path / "results.json"
  results.write_text(json.dumps(dict(rows=_rows())))
  assert scaling.main(["--results", str(results), "--examples", "block_1000=1000",
                       "--examples", "block_10000=10000", "--extrapolate-to", "100000"]) == 0
  table = (tmp_path / "scaling.md").read_text()
  assert (tmp_path / "scaling.png").stat().st_size > 0
  # sd: 1.1 + 0.2 * 5 = 2.1 at 100k, stated as an extrapolation.
  assert "| block | sd/all | 1.100 + 0.200·log10(n) | 2.10 |" in table
  assert "not measured" in table
  assert "| block_1000 | 1,000 | dloop/all | 1.800 | 20% | 100% |" in table
  assert "block_1000" in capsys.readouterr().out
  # A label the results do not have: one line, exit 2.
  assert scaling.main(["--results", str(results), "--examples", "eagle3_1000=1000"]) == 2
  assert "eagle3_1000" in capsys.readouterr().err
