"""`python -m infer.device_check --preset tiny` on the CPU: every check runs and passes, the files
and the verdict say so; a comparison that finds different tokens is a FAIL."""

from __future__ import annotations

import json

import pytest

from dloop_jax.decoding import GenerationOutput, RowStats
from infer.device_check import __main__ as device_check
from infer.device_check import checks, report


def test_tiny_check_passes_and_writes_its_files(tmp_path, capsys):
  assert device_check.main(["--preset", "tiny", "--out", str(tmp_path)]) == 0
  out, err = capsys.readouterr()
  verdict = out.strip().splitlines()[-1]
  assert verdict.startswith("PASS device_check tiny on "), out
  for word in ("fixed_bf16 PASS", "free_f32 PASS", "tree_f32 PASS", "sampling PASS", "speed OK",
               "prefill OK", "prefill skipped at 256 tokens"):
    assert word in verdict, verdict
  assert "greedy fixed width 5, bf16, batch 4" in err and "s] prefill 64:" in err

  result = json.loads((tmp_path / "results.json").read_text())
  assert result["verdict"] == dict(line=verdict, ok=True)
  assert result["format"] == report.FORMAT and result["shape"]["width"] == 5
  for name, modes in (("fixed_bf16", ["ar", "sd", "dloop"]), ("free_f32", ["ar", "sd", "dloop"]),
                      ("tree_f32", ["ar", "dloop/tree4"])):
    entry = result["correctness"][name]["4"]
    assert entry["ok"] and list(entry["runs"]) == modes, entry
    for mode in modes[1:]:
      run = entry["runs"][mode]
      assert run["comparison"]["rows"] == 4 and not run["stats_problems"]
      assert run["drafted"] > 0 and run["new_tokens"] == 4 * (166 if name == "fixed_bf16" else 24)
  assert result["correctness"]["free_f32"]["4"]["runs"]["sd"]["plain_rounds"] > 0  # pauses
  assert result["sampling"]["ok"] and result["sampling"]["new_tokens"] == 4 * 24

  speed = result["speed"]["4"]
  assert set(speed["cost_ms"]) == {"1", "5"} and speed["drafter"]["stage_ms"] > 0
  for name in ("ar", "ar_fixed", "dloop"):
    assert speed[name]["iterations"] == [165, 119] and speed[name]["isolated_ms"] > 0
  prefill = {p["length"]: p for p in result["prefill"]}
  assert prefill[64]["tokens_per_s"] > 0 and "context window of 256" in prefill[256]["skipped"]

  md = (tmp_path / "summary.md").read_text()
  assert verdict in md and "| greedy fixed-width bf16 (exact) | 4 | ar, sd, dloop |" in md
  assert "| 256 | skipped: past the context window" in md


def test_different_tokens_are_a_failure(tiny):
  prompts = [[1, 2, 3], [4, 5]]
  same = checks.compare_outputs(reference=[[7, 8, 9], [1, 1]], got=[[7, 8, 9], [1, 1]],
                                prompts=prompts, exact=True)
  assert same["ok"] and same["identical_rows"] == 2 and not same["mismatches"]
  broken = checks.compare_outputs(reference=[[7, 8, 9], [1, 1]], got=[[7, 8, 10], [1, 1]],
                                  prompts=prompts, exact=True)
  assert not broken["ok"] and broken["identical_rows"] == 1
  assert broken["mismatches"][0]["row"] == 0 and broken["mismatches"][0]["first_difference"] == 2
  # Under the near-tie rule a difference passes only where the target's top-2 gap is tiny:
  # the tiny target's logits are far apart, and with no target there is no gap to excuse it.
  ruled = checks.compare_outputs(reference=[[7, 8, 9], [1, 1]], got=[[7, 8, 10], [1, 1]],
                                 prompts=prompts, target=tiny, exact=False)
  assert not ruled["ok"] and ruled["mismatches"][0]["top2_gap"] > 1e-3
  assert not checks.compare_outputs(reference=[[7]], got=[[8]], prompts=[[1]], exact=False)["ok"]
  assert not checks.compare_outputs(reference=[[7], [8]], got=[[7]], prompts=prompts,
                                    exact=True)["ok"]


def test_statistics_that_do_not_add_up_are_reported():
  row = dict(new_tokens=3, rounds=2, committed_in_rounds=2, drafted=4, verified=4, accepted=0,
             target_tokens=10, stage_histogram=[0, 2])
  out = GenerationOutput(tokens=[[1, 2, 3]], rows=[RowStats(**row)], seconds=1.0,
                         compile_seconds=0.0, mode="sd")
  assert checks.stats_problems(out, max_new_tokens=3, vocab_size=64, fixed_width=5) == []
  bad = GenerationOutput(tokens=[[1, 2, 70]], rows=[RowStats(**dict(
      row, accepted=5, stage_histogram=[0, 1], target_tokens=9))], seconds=1.0,
                         compile_seconds=0.0, mode="sd")
  problems = " | ".join(checks.stats_problems(bad, max_new_tokens=3, vocab_size=64,
                                              fixed_width=5))
  for words in ("outside [0, 64)", "accepted 5, verified 4", "sums to 1", "fixed width 5"):
    assert words in problems, problems


def test_a_failed_check_makes_the_verdict_fail():
  result = dict(preset="tiny", device=dict(device_kind="cpu", backend="cpu"),
                correctness=dict(fixed_bf16={"1": dict(ok=True)}, free_f32={"1": dict(ok=False)}),
                sampling=dict(ok=True), speed={"1": dict(error="RuntimeError: boom")},
                prefill=[dict(length=64, tokens_per_s=1.0), dict(length=9, skipped="context")])
  line, ok = report.verdict(result)
  assert not ok and line.startswith("FAIL device_check tiny on cpu (cpu):")
  assert "fixed_bf16 PASS, free_f32 FAIL, sampling PASS, speed ERROR, prefill OK" in line
  result["correctness"]["free_f32"]["1"]["ok"] = True
  result["speed"] = {"1": {}}
  line, ok = report.verdict(result)
  assert ok and line.startswith("PASS") and "prefill skipped at 9 tokens" in line


@pytest.mark.parametrize("argv, words", [
    (["--preset", "huge"], ["Unknown preset 'huge'", "default", "tiny"]),
    (["--preset", "tiny", "--batches", "0"], ["--batches takes integers >= 1"]),
])
def test_bad_arguments_are_clear_errors(argv, words, tmp_path, capsys):
  assert device_check.main(argv + ["--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert all(w in err for w in words), err
