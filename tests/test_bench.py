"""`python -m infer.bench`: aggregation, the results file, plots (a real run:
tests/test_real_model_commands.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from dloop_jax.decoding import DecodingConfig
from dloop_jax.errors import ConfigError
from dloop_jax.data import bench_prompts as prompts_lib
from infer.bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rec(category, method, drafter, tokens, seconds, *, rounds=0, committed=0, hist=(),
         identical=True, drafted=0, verified=0, plain=0):
  return dict(category=category, method=method, drafter=drafter, new_tokens=tokens,
              seconds=seconds, rounds=rounds, committed_in_rounds=committed,
              stage_histogram=list(hist), target_forwards=rounds + 1, drafter_forwards=0,
              identical_to_ar=identical, lossless_vs_ar=True, drafted=drafted,
              verified=verified, plain_rounds=plain)


def test_summary_sums_tokens_and_seconds_per_category_and_overall():
  records = [
      _rec("math", "ar", "", 100, 4.0, rounds=99, committed=99),
      _rec("math", "ar", "", 50, 1.0, rounds=49, committed=49),
      _rec("math", "dloop", "d", 100, 2.0, rounds=40, committed=99, hist=(0, 30, 10),
           drafted=200, verified=150, plain=10),
      _rec("math", "dloop", "d", 50, 1.0, rounds=20, committed=49, hist=(0, 20, 0),
           identical=False, drafted=80, verified=60, plain=0),
      _rec("chat", "ar", "", 60, 3.0, rounds=59, committed=59),
      _rec("chat", "dloop", "d", 60, 1.0, rounds=30, committed=59, hist=(0, 30, 0)),
  ]
  rows = {(r["category"], r["method"]): r for r in report.summarize(records)}
  math_dloop = rows[("math", "dloop")]
  assert math_dloop["tokens_per_second"] == pytest.approx(150 / 3.0)  # totals, not a mean of rates
  assert math_dloop["speedup_vs_ar"] == pytest.approx((150 / 3.0) / (150 / 5.0))
  assert math_dloop["acceptance_length"] == pytest.approx(148 / 60)
  assert math_dloop["stages_per_round"] == pytest.approx((30 + 20 + 2 * 10) / 60)
  assert math_dloop["identical_to_ar"] == pytest.approx(0.5)
  assert math_dloop["verified_fraction"] == pytest.approx(210 / 280)
  assert math_dloop["plain_round_fraction"] == pytest.approx(10 / 60)
  assert rows[("math", "ar")]["verified_fraction"] is None
  overall = rows[("overall", "dloop")]
  assert overall["prompts"] == 3
  assert overall["speedup_vs_ar"] == pytest.approx((210 / 4.0) / (210 / 8.0))
  assert rows[("overall", "ar")]["speedup_vs_ar"] == pytest.approx(1.0)
  table = report.markdown(report.summarize(records))
  assert "| overall | dloop | d | 3 |" in table


def test_tree_rows_keep_their_budget_and_are_plotted_against_it(tmp_path):
  """Tree rows (sd / dloop at budgets B) summarize per budget, model their speedup from the
  forwards they ran, and make the tree plot; chains alone make none."""
  records = [_rec("math", "ar", "", 40, 4.0, rounds=39, committed=39)]
  for budget, forwards in ((0, 20), (8, 12), (16, 10)):
    for mode in ("sd", "dloop"):
      method = mode if budget == 0 else f"{mode}/tree{budget}/all"
      rec = _rec("math", method, "block", 40, 2.0, rounds=forwards - 1, committed=39,
                 hist=(0, forwards - 1), drafted=60, verified=60)
      rec.update(mode=mode, tree_budget=budget, target_forwards=forwards,
                 drafter_forwards=forwards - 1, draft_cost_ratio=0.1)
      records.append(rec)
  rows = report.summarize(records)
  overall = {r["method"]: r for r in rows if r["category"] == "overall"}
  tree = overall["dloop/tree16/all"]
  assert (tree["mode"], tree["tree_budget"]) == ("dloop", 16)
  assert tree["acceptance_length"] == pytest.approx(39 / 9)
  assert tree["modeled_tokens_per_step"] == pytest.approx(40 / (10 + 0.1 * 9))
  assert tree["modeled_speedup"] == pytest.approx(
      tree["modeled_tokens_per_step"] / overall["ar"]["modeled_tokens_per_step"])
  assert "| overall | dloop/tree16/all | block |" in report.markdown(rows)
  assert report.plot_trees(rows, str(tmp_path / "trees.png"))
  assert (tmp_path / "trees.png").stat().st_size > 0
  chains = [r for r in rows if not r["tree_budget"]]
  assert not report.plot_trees(chains, str(tmp_path / "none.png"))
  assert not (tmp_path / "none.png").exists()


def test_prompt_sets_are_bundled_and_interleaved():
  got = prompts_lib.load(["math", "code"], per_category=2)
  math = [p for p in got if p.category == "math"]
  assert [p.set_name for p in math[:4]] == ["gsm8k", "math500", "gsm8k", "math500"]
  code = [p for p in got if p.category == "code"]
  assert code[0].id == "HumanEval/0" and "def " in code[0].text
  with pytest.raises(Exception, match="Unknown categories"):
    prompts_lib.load(["poetry"], per_category=1)


def test_no_drafters_excludes_drafters():
  proc = subprocess.run([sys.executable, "-m", "infer.bench", "--no-drafters", "--drafters", "x"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "--drafters: not allowed with argument --no-drafters" in proc.stderr


def test_a_run_that_compiled_is_repeated_and_the_repeat_timed():
  from infer.bench import methods

  class Fake:
    def __init__(self, compiles):
      self.calls, self.compiles = 0, compiles

    def run(self, ids, **kw):
      self.calls += 1
      cold = self.calls == 1 and self.compiles
      return methods.Run(tokens=list(ids), seconds=5.0 if cold else 2.0,
                         compile_seconds=1.5 if cold else 0.0)

  fresh, warm = Fake(compiles=True), Fake(compiles=False)
  run = methods.timed_run(fresh, [1, 2], gate=-1.0)
  assert (fresh.calls, run.seconds, run.compile_seconds) == (2, 2.0, 1.5)
  run = methods.timed_run(warm, [1, 2])
  assert (warm.calls, run.seconds, run.compile_seconds) == (1, 2.0, 0.0)


def test_repeats_interleave_the_methods_and_keep_each_ones_median_run():
  from infer.bench import methods

  calls = []

  class Fake:
    def __init__(self, name, seconds):
      self.name, self.seconds = name, list(seconds)

    def run(self, ids, **kw):
      calls.append(self.name)
      return methods.Run(tokens=list(ids), seconds=self.seconds.pop(0))

  a, b, c = Fake("a", [3.0, 1.0, 2.0]), Fake("b", [5.0, 4.0, 6.0]), Fake("c", [1.0, 9.0, 2.0])
  runs = methods.interleaved_runs([a, b, c], [7], repeats=3, rotation=1)
  # Pass r starts at method (1 + r) % 3.
  assert calls == ["b", "c", "a", "c", "a", "b", "a", "b", "c"]
  assert [runs[id(m)].seconds for m in (a, b, c)] == [2.0, 5.0, 2.0]
  with pytest.raises(ConfigError, match="repeats"):
    methods.interleaved_runs([a], [7], repeats=0)


def test_bad_repeats_fails_before_the_target_loads():
  proc = subprocess.run([sys.executable, "-m", "infer.bench", "--repeats", "0"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "--repeats must be >= 1" in proc.stderr


def _ours(**options):
  from infer.bench import methods  # pylint: disable=g-import-not-at-top
  weights = options.pop("weights", "")
  return methods.Ours(decoding=DecodingConfig(**options), target=None, weights=weights)


class _Drafter:
  """What the benchmark and `resolve` read of a drafter."""

  kind = "parallel"

  def __init__(self, name, *, block_size=4, supports_trees=False, has_confidence=False):
    self.name, self.block_size = name, block_size
    self.supports_trees, self.has_confidence = supports_trees, has_confidence

  def max_block_size(self):
    return self.block_size

  def check_target(self, config):
    del config


F32_TARGET = types.SimpleNamespace(weight_dtype=np.dtype("float32"), dtype=np.dtype("float32"),
                                   config=None)


def test_a_second_weight_storage_is_named_and_measured_against_the_reference_ar():
  names = [_ours(mode=m, weights=w, schedule=s, fixed_width=fw).method_name
           for m, w, s, fw in [("ar", "", "cost", 0), ("ar", "bf16", "cost", 5),
                               ("sd", "bf16", "off", 5), ("dloop", "bf16", "cost", 0),
                               ("dloop", "", "off", 13)]]
  assert names == ["ar", "ar/w5@bf16", "sd/all/w5@bf16", "dloop@bf16", "dloop/all/w13"]
  records = [
      _rec("math", "ar", "", 100, 4.0, rounds=99, committed=99),
      _rec("math", "ar@bf16", "", 100, 5.0, rounds=99, committed=99),
      _rec("math", "sd/all/w5@bf16", "d", 100, 2.0, rounds=50, committed=99),
  ]
  rows = {r["method"]: r for r in report.summarize(records) if r["category"] == "math"}
  assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
  assert rows["ar@bf16"]["speedup_vs_ar"] == pytest.approx(0.8)  # against the reference's ar
  assert rows["sd/all/w5@bf16"]["speedup_vs_ar"] == pytest.approx(2.0)


@pytest.mark.parametrize("weights", ["f16", "bf16,bf16", ""])
def test_bad_weights_fail_before_the_target_loads(weights):
  proc = subprocess.run([sys.executable, "-m", "infer.bench", f"--weights={weights}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "--weights takes f32, bf16 and / or int8" in proc.stderr


def test_fixed_width_methods_fit_the_width(capsys):
  """--fixed-widths 5: sd verifies the drafter's 4 drafts, dloop the 2 x 2 loop that fits."""
  from infer.bench import __main__ as bench_main  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import SamplingConfig  # pylint: disable=g-import-not-at-top
  from dloop_jax.decoding import config as config_lib  # pylint: disable=g-import-not-at-top

  # python -m infer's default: the prompt lookup for greedy chains, none when sampling.
  assert bench_main._lookups(bench_main._parse([]).lookups, SamplingConfig()) == ["prompt"]
  assert bench_main._lookups(None, SamplingConfig(temperature=0.7)) == ["off"]
  assert bench_main._lookups(["off", "prompt"], SamplingConfig()) == ["off", "prompt"]
  args = bench_main._parse(["--fixed-widths", "5", "--lookups", "off"])
  drafter = _Drafter("block")

  def shapes(widths, base=DecodingConfig()):
    got = bench_main._our_methods(args, base=base, target=F32_TARGET,
                                  drafters=[("block", drafter)], weights="",
                                  modes=["sd", "dloop"], schedules=["off"], tree_schedules=[],
                                  fixed_widths=widths, common={})
    # What each runs: the resolution generate() makes too.
    resolved = [(m.method_name, config_lib.resolve(m.decoding, target=F32_TARGET,
                                                   drafter=m.drafter)) for m in got]
    return {(name, c.block_size, c.max_stages) for name, c in resolved if c.fixed_width}

  assert shapes([5]) == {("ar/w5", None, 3), ("sd/all/w5", 4, 1), ("dloop/all/w5", 2, 2)}
  # A width too narrow for two stages is passed over, not an error.
  assert shapes([2, 9]) == {("ar/w2", None, 3), ("ar/w9", None, 3), ("sd/all/w9", 4, 1),
                            ("dloop/all/w9", 4, 2)}
  # A width no mode fits: left out, with resolve's reason.
  assert shapes([3], base=DecodingConfig(block_size=4)) == {("ar/w3", 4, 3)}
  assert "sd/all/w3 skipped: fixed_width=3 is narrower than a verification" in (
      capsys.readouterr().err)


def test_probability_confidence_rows_only_for_a_learned_confidence_under_the_cost_schedule(
    monkeypatch):
  """--confidences auto,probability: sd / dloop and sd~prob / dloop~prob for DSpark's chains
  scheduled by cost; one row per mode elsewhere (no learned confidence, "/all", trees)."""
  from infer.bench import __main__ as bench_main  # pylint: disable=g-import-not-at-top

  args = bench_main._parse(["--confidences", "auto,probability", "--tree-budgets", "0,8",
                            "--lookups", "off"])
  dspark = _Drafter("dspark", supports_trees=True, has_confidence=True)
  block = _Drafter("block")
  monkeypatch.setattr(bench_main, "_cost_table", lambda *a, **k: None)  # no real target here
  got = bench_main._our_methods(args, base=DecodingConfig(), target=F32_TARGET,
                                drafters=[("ds", dspark), ("b", block)],
                                weights="", modes=["sd", "dloop"], schedules=["cost", "off"],
                                tree_schedules=["cost"], fixed_widths=[], common={})
  rows = sorted((m.drafter_label, m.method_name, m.decoding.confidence) for m in got
                if m.drafter_label)
  assert rows == sorted([
      ("ds", "sd", "auto"), ("ds", "sd~prob", "probability"), ("ds", "sd/all", "auto"),
      ("ds", "dloop", "auto"), ("ds", "dloop~prob", "probability"), ("ds", "dloop/all", "auto"),
      ("ds", "sd/tree8", "auto"), ("ds", "dloop/tree8", "auto"),
      ("b", "sd", "auto"), ("b", "sd/all", "auto"), ("b", "dloop", "auto"),
      ("b", "dloop/all", "auto")])
  order = [r["method"] for r in report.summarize(
      [_rec("math", m, "ds", 10, 1.0) for m in ("dloop~prob", "sd/all", "sd~prob", "ar", "sd")])]
  assert order[:5] == ["ar", "sd", "sd~prob", "sd/all", "dloop~prob"]


def test_rows_keep_each_mode_together_across_widths_and_weights():
  names = ["dloop/all/w5@bf16", "sd/w5@bf16", "ar/w5@bf16", "dloop/w5@bf16", "sd/all/w5@bf16",
           "sd~prob/w5@bf16", "ar@bf16", "sd/tree8/all", "sd", "ar", "hf", "sd/tree8"]
  order = [r["method"] for r in report.summarize([_rec("math", m, "d", 10, 1.0) for m in names])
           if r["category"] == "math"]
  assert order == ["ar", "ar@bf16", "ar/w5@bf16", "sd", "sd/w5@bf16", "sd~prob/w5@bf16",
                   "sd/tree8", "sd/all/w5@bf16", "sd/tree8/all", "dloop/w5@bf16",
                   "dloop/all/w5@bf16", "hf"]


def test_bad_confidences_fail_before_the_target_loads():
  proc = subprocess.run([sys.executable, "-m", "infer.bench", "--confidences", "head"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "--confidences takes auto and / or probability" in proc.stderr


def test_lookup_methods_are_named_and_follow_their_chain():
  names = [_ours(mode="sd", schedule=s, lookup=lookup).method_name
           for s in ("cost", "off") for lookup in ("off", "prompt")]
  assert names == ["sd", "sd+lookup", "sd/all", "sd/all+lookup"]
  recs = [_rec("code", m, "d", 10, 1.0) for m in reversed(names)]
  assert [r["method"] for r in report.summarize(recs) if r["category"] == "code"] == names
