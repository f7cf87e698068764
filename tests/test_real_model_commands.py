"""The real default model through the commands users run: the benchmark, `python -m infer`
and the quickstart notebook.

Every run here decodes math prompts of the benchmark (GSM8K test problem 0: 96 tokens with
the chat template; MATH-500 problem 0: 79) for 24 new tokens, one row at a time, in ar or
dloop with the default S_max and schedule: they need the same compiled programs (ar, and
dloop for each shipped drafter, at one prompt and cache size). The benchmark runs first and
compiles them; `python -m infer` and the notebook's kernel load them from the test run's
persistent compilation cache (conftest) instead of compiling them again. One module, so one
test process runs them, in this order.

The benchmark also checks every dloop output against ar's: this is the shipped drafters'
losslessness on the real model (sd is dloop with one stage a round: the sweep's g = +inf
below and the notebook's; every mode, shape, gate and schedule on tiny targets in
tests/test_engine_*.py). Each drafter is a program of its own that takes about 45 seconds
to compile with the flags users get, so the default run checks the default drafter (block);
DLOOP_TEST_EVERY_SHIPPED_DRAFTER=1 adds Domino, DSpark and EAGLE-3 (their kinds are checked
on tiny targets in tests/test_domino.py, tests/test_dspark.py, tests/test_eagle3.py and
tests/test_lossless_matrix.py, the shipped EAGLE-3 through its Hugging Face layout in
tests/test_hf_formats.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

import model_fixtures
from dloop_jax import profiles
from dloop_jax.models import load_target
from dloop_jax.data import bench_prompts as prompts_lib
from lossless import assert_same_or_near_tie

pytestmark = pytest.mark.real_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
SHIPPED = ("smollm2-135m-instruct-block", "smollm2-135m-instruct-domino",
           "smollm2-135m-instruct-dspark", "smollm2-135m-instruct-eagle3")  # best first
CHECKED = SHIPPED if os.environ.get("DLOOP_TEST_EVERY_SHIPPED_DRAFTER") == "1" else SHIPPED[:1]
MAX_NEW = 24  # the notebook's MAX_NEW_TOKENS: the same cache size, the same programs
REQUIRED = ("category", "method", "drafter", "tokens_per_second", "speedup_vs_ar",
            "acceptance_length", "identical_to_ar")


def _env() -> dict[str, str]:
  # The flags users get: these runs check the shipped drafters' losslessness (conftest).
  return dict(os.environ, XLA_FLAGS=os.environ["DLOOP_TEST_REAL_MODEL_XLA_FLAGS"])


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  """The benchmark on the first two math prompts with the checked drafters: (results, dir)."""
  out = tmp_path_factory.mktemp("bench")
  proc = subprocess.run(
      [sys.executable, "-m", "infer.bench", "--no-peers", "--drafters", ",".join(CHECKED),
       "--categories", "math",
       "--prompts-per-category", "2", "--max-new-tokens", str(MAX_NEW), "--modes", "dloop",
       "--weights", "f32", "--fixed-widths", "",
       "--schedules", "cost", "--sweep", "--sweep-gates=-inf,inf,auto",
       "--sweep-max-stages=3",
       "--sweep-prompts", "1", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((out / "results.json").read_text()), out


def test_benchmark_writes_results_table_and_plots(bench):
  result, out = bench
  rows = result["rows"]
  for row in rows:
    assert all(k in row for k in REQUIRED), row
  keys = {(r["category"], r["method"]) for r in rows}
  for category in ("math", "overall"):
    for method in ("ar", "dloop+lookup"):  # python -m infer's default: the prompt lookup on
      assert (category, method) in keys
  assert ("overall", "sd+lookup") not in keys  # --modes dloop
  overall = {(r["method"], r["drafter"]): r for r in rows if r["category"] == "overall"}
  ar = overall["ar", ""]
  assert result["config"]["cost_table"]["costs"]["1"] > 0
  # The results travel: the output directory is recorded without this machine's path.
  assert str(out) not in (out / "results.json").read_text()
  assert result["config"]["out"] == "/".join(str(out).split(os.sep)[-2:])
  # Modeled accelerator speedup: every forward one step, a drafter forward (its layers) / 30.
  assert ar["modeled_speedup"] == 1.0
  for (method, _), row in overall.items():
    assert method == "ar" or row["verified_fraction"] <= 1
    assert row["modeled_speedup"] == pytest.approx(
        row["modeled_tokens_per_step"] / ar["modeled_tokens_per_step"]), method
  sweep = result["sweep"]
  inf = float("inf")
  # Every gate, gate="auto" (the shipped drafter's calibration) included, under this
  # machine's costs (the gpu profile's would compile other verification widths).
  assert sorted((str(p["gate"]), p["max_stages"], p["costs"]) for p in sweep) == sorted(
      (g, 3, "machine") for g in ("-inf", "inf", "auto"))
  for point in sweep:
    assert point["lossless_vs_ar"] == point["prompts"], point  # identical, or after a near-tie
    # g = -inf drafts S_max stages every round but the lookup's (one stage: the sweep
    # runs the default lookup stage), g = +inf one (sd's rounds).
    if point["gate"] == -inf:
      assert 1.0 < point["stages_per_round"] <= 3.0, point
    elif point["gate"] == inf:
      assert point["stages_per_round"] == 1.0, point
    else:
      assert 1.0 <= point["stages_per_round"] <= 3.0, point
  for name in ("results.md", "speedup.png", "gate_sweep.png"):
    assert (out / name).stat().st_size > 0
  assert not (out / "trees.png").exists()  # chains only: no tree plot
  assert "| overall | dloop+lookup |" in (out / "results.md").read_text()


def test_shipped_drafters_are_lossless_and_accepted_on_the_real_model(bench):
  """dloop with each shipped drafter reproduces ar's greedy tokens on both prompts."""
  result, _ = bench
  records = result["records"]
  assert {r["drafter"] for r in records if r["drafter"]} == set(CHECKED)
  assert {r["prompt_id"] for r in records} == {"gsm8k/test/0", "math500/test/0"}
  # ar, then dloop with each drafter, on each prompt.
  assert len(records) == 2 * (1 + len(CHECKED))
  for rec in records:
    assert rec["identical_to_ar"] or rec["lossless_vs_ar"], {k: rec[k] for k in (
        "prompt_id", "method", "drafter", "identical_to_ar", "lossless_vs_ar")}
  # The sweep's rounds all draft (no back-off): a trained drafter gets some drafts accepted.
  for name in CHECKED:
    best = max(p["acceptance_length"] for p in result["sweep"] if p["drafter"] == name)
    assert best > 1.0, name


def test_infer_defaults_to_dloop_with_the_best_shipped_drafter(bench):
  """Default: dloop with the block drafter and this machine's profile (bf16 weights at width 5
  with AMX, f32 weights at free widths without), and the same tokens as `--mode ar`."""
  result, _ = bench  # it compiled the f32 programs and the tokenizer-side caches
  problem = prompts_lib.load(["math"], per_category=1)[0]
  profile = profiles.resolve("cpu")

  def infer(*extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "infer", "--prompt", problem.text, "--max-new-tokens",
         str(MAX_NEW), "--json", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    # No warning from inside the library: at most one line of its own per choice made.
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

  rec = infer()
  assert rec["mode"] == "dloop" and rec["drafter"] == "block"
  assert rec["weights"] == profile.weights
  assert rec["new_tokens"] == len(rec["output_ids"]) > 0
  assert rec["acceptance_length"] >= 1.0 and rec["rounds"] >= 1
  if profile.weights == "bf16":
    ar = infer("--mode", "ar")
    assert ar["weights"] == "bf16" and rec["fixed_width"] == ar["fixed_width"] == 5
    assert rec["output_ids"] == ar["output_ids"]  # bit-exact at one width
  else:
    # f32 at free widths: the benchmark's ar run of the same problem (f32, the same chat
    # template, stop tokens and length) is `--mode ar`'s; a near-tie at most.
    ar = next(r for r in result["records"] if r["method"] == "ar" and r["prompt_id"] == problem.id)
    assert rec["fixed_width"] is None and ar["prompt_tokens"] == len(rec["prompt_ids"])
    if rec["output_ids"] != ar["tokens"]:
      target = load_target(model_fixtures.REAL_MODEL, dtype="float32").model
      assert_same_or_near_tie(target, rec["prompt_ids"], ar["tokens"], rec["output_ids"])


def test_quickstart_notebook_runs(bench):
  del bench  # it compiled the notebook's programs
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # Committed without outputs: the repository holds the source, not a run.
  assert all(not c.get("outputs") and c.get("execution_count") is None
             for c in nb.cells if c.cell_type == "code")
  env = dict(_env(),
             PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": ROOT}})
  client.execute(env=env)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
  for mode in ("ar", "sd", "dloop"):
    assert f"{mode:>5}: tau" in text, text
  assert "same tokens as ar: True" in text and "same tokens as ar: False" not in text
  assert "g = -8.00" in text
  assert any("image/png" in o.get("data", {}) for o in nb.cells[-2].outputs), "no plot"
