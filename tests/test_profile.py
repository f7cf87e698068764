"""`python -m infer.profile` on the CPU with the tiny preset: it measures, writes its tables, and
the per-width table is one the scheduler reads."""

from __future__ import annotations

import json

import pytest

from dloop_jax.decoding import costs as costs_lib
from dloop_jax.errors import ConfigError
from dloop_jax.models.config import tiny_config
from infer.profile import __main__ as profile
from infer.profile import modeled, presets

# gamma 2, S_max 2: the generation verifies width 5; trees of budget 2 add widths 3 (one stage)
# and 7 (two: 2 + 2 nodes and the first stage's best path of 2).
ARGS = ["--preset", "tiny", "--block-size", "2", "--max-stages", "2", "--widths", "1,2",
        "--tree-budgets", "2", "--drafters", "block", "--max-new-tokens", "5", "--repeats", "1",
        "--tau", "paper,2.5"]


def test_tiny_profile_writes_tables_the_scheduler_reads(tmp_path, capsys):
  assert profile.main(ARGS + ["--out", str(tmp_path)]) == 0
  log = capsys.readouterr().err
  assert "rounds/s" in log and "costs.json" in log

  table = costs_lib.load(tmp_path / "costs.json")
  assert table.widths == (1, 2, 3, 5, 7)
  assert table.key["target"] == "tiny (random weights)" and table.key["batch_size"] == 1
  # What generate(costs=FILE) does with it at the compiled widths of gamma 2, S_max 2.
  assert costs_lib.resolve(str(tmp_path / "costs.json"), target=None, batch_size=1,
                           widths=(1, 3, 5)).shape == (3,)

  result = json.loads((tmp_path / "profile.json").read_text())
  assert result["target"]["shape"]["qk_norm"] and result["target"]["shape"]["family"] == "qwen3"
  assert result["tree_widths"] == [3, 7]
  block = result["drafters"]["block"]
  assert block["stage_ms"] > 0 and block["commit_ms"] > 0 and block["params"] > 0
  gen = result["generation"]
  assert gen["width"] == 5 and 1 <= gen["rounds"] <= 4 and gen["rounds_per_s"] > 0
  m = result["modeled"]
  assert m["label"] == "modeled" and m["stages"] == [1, 2]
  # The paper rows of the measured kind (DFlash: tau 4.03 fits 1 + 2 * 2 at S = 2 only).
  dflash = [r for r in m["rows"] if r["source"].startswith("DFlash, Qwen3-8B, 16")]
  assert len(dflash) == 1 and dflash[0]["speedup"][0] is None and dflash[0]["speedup"][1] > 0
  given = next(r for r in m["rows"] if r["source"] == "given")
  step, round_ms = table.costs[1], m["round_ms"]["block"][0]
  assert round_ms == pytest.approx(float(table.at([3])[0]) + block["stage_ms"]
                                   + block["commit_ms"])
  assert given["speedup"][0] == pytest.approx(2.5 * step / round_ms)

  md = (tmp_path / "profile.md").read_text()
  assert "## Modeled speedup (not measured)" in md and "| block | 2.50 | given |" in md


@pytest.mark.parametrize("argv, words", [
    (["--preset", "qwen3-70b"], ["Unknown preset 'qwen3-70b'", "qwen3-4b", "tiny"]),
    (["--preset", "tiny", "--set", "layers=3"], ["field=value", "num_layers"]),
    (["--preset", "tiny", "--drafters", "medusa"], ["Unknown drafter kinds ['medusa']"]),
    (["--preset", "tiny", "--tau", "0.5"], ["tokens per round, >= 1"]),
])
def test_bad_input_is_a_clear_error(argv, words, tmp_path, capsys):
  assert profile.main(argv + ["--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert all(w in err for w in words), err
  assert not list(tmp_path.iterdir())


def test_shapes_that_do_not_fit_say_so():
  config, _ = presets.preset_config("qwen3-8b")
  with pytest.raises(ConfigError, match=r"qwen3-8b in bfloat16 needs about 1[5-9]\.\d GiB.*has"
                     r" 8\.0 GiB.*--set num_layers"):
    presets.check_fits(config, dtype="bfloat16", weights="bfloat16", batch_size=1, capacity=512,
                       available=8 * 2 ** 30, preset="qwen3-8b")
  small = presets.check_fits(tiny_config(), dtype="float32", weights="float32", batch_size=1,
                             capacity=256, available=2 ** 30, preset="tiny")
  assert 0 < small["total"] < 2 ** 20


def test_qwen3_presets_have_the_published_shapes():
  c4, d4 = presets.preset_config("qwen3-4b")
  c8, d8 = presets.preset_config("qwen3-8b", "num_layers=12")
  assert d4 == d8 == "bfloat16" and c4.qk_norm and c4.family == "qwen3"
  assert 4.0e9 < c4.num_params() < 4.1e9  # Qwen3-4B: 4.02B with tied embeddings
  assert c8.num_layers == 12 and c8.hidden_size == 4096 and not c8.tie_embeddings
  assert 8.1e9 < presets.preset_config("qwen3-8b")[0].num_params() < 8.3e9  # 8.19B
  assert [e["kind"] for e in modeled.parse_taus("paper", ["dspark"])] == ["dspark"]


def test_budget_extrapolates_from_one_and_two_layers():
  """`python -m infer.profile.budget` compiles 1- and 2-layer programs and extrapolates to the
  model's depth: every layer is the same program, so a 3-layer program's bytes lie on the line.
  (The 8B shapes of the command: the docs' table; here a tiny target in bf16.)"""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from infer.profile import budget  # pylint: disable=g-import-not-at-top

  base = tiny_config(family="qwen3", qk_norm=True, vocab_size=256)
  costs = [budget.compiled_cost(dataclasses.replace(base, num_layers=n), batch=2, capacity=96,
                                context=64, width=1) for n in (1, 2, 3)]
  layer = costs[1] - costs[0]
  assert layer.bytes_accessed > 0 and layer.flops > 0
  line = costs[0] + layer * 2
  assert line.bytes_accessed == pytest.approx(costs[2].bytes_accessed, rel=0.02)
  assert line.flops == pytest.approx(costs[2].flops, rel=0.02)
  rows = [dict(model="tiny", batch=2, context=64, capacity=96, width=1, weights=1e9, cache=1e9,
               **dataclasses.asdict(costs[2]))]
  table = budget.markdown(rows)
  assert "| tiny | 2 | 64 | 96 | decode (1 token) |" in table
  assert budget.capacity_for(32768) == 49152 and budget.capacity_for(1024) == 1536
