"""README.md's Python runs as written, and its two commands are the ones users and CI run.

Each ```python block runs in a fresh interpreter from the repository root (the real model's
compiler flags, as the command-line runs of tests/test_real_model_commands.py): a newcomer's
first copy-paste must work, and what it prints must show real decoding, not just no error.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GENERATE_COMMAND = ('bash scripts/setup.sh && .venv/bin/python -m infer --prompt'
                    ' "Explain speculative decoding in two sentences."')
TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest"
# The statistics line of the example that calls dl.generate().
STATS = re.compile(r"tau (\d+\.\d+): (\d+) tokens in (\d+) target forwards, (\d+) of (\d+) drafts"
                   r" accepted, (\d+\.\d+) stages a round")


def _python_blocks() -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"),
                    flags=re.MULTILINE | re.DOTALL)


def _bash_lines() -> list[str]:
  blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"),
                      flags=re.MULTILINE | re.DOTALL)
  return [line.strip() for block in blocks for line in block.splitlines()]


def test_the_two_commands_are_in_the_readme_and_ci_runs_the_test_one():
  lines = _bash_lines()
  assert GENERATE_COMMAND in lines and TEST_COMMAND in lines, lines
  ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
  assert TEST_COMMAND in [line.strip() for line in ci], ci


@pytest.mark.real_model
def test_python_examples_run_and_decode():
  blocks = _python_blocks()
  assert any("dl.generate(" in code for code in blocks), "no generate() example in README.md"
  # As a user runs it: the flags users get (conftest).
  env = dict(os.environ, XLA_FLAGS=os.environ["DLOOP_TEST_REAL_MODEL_XLA_FLAGS"])
  for code in blocks:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{code}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{code}\nprinted nothing"
    if "dl.generate(" not in code:
      continue
    lines = proc.stdout.splitlines()
    stats = [i for i, line in enumerate(lines) if STATS.search(line)]
    assert len(stats) == 1, proc.stdout
    text = "\n".join(lines[:stats[0]])
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 5, proc.stdout  # words, not ids
    tau, new, forwards, accepted, drafted, stages = STATS.search(lines[stats[0]]).groups()
    tau, new, forwards = float(tau), int(new), int(forwards)
    accepted, drafted, stages = int(accepted), int(drafted), float(stages)
    # A prefill forward gives the first token, each later forward commits tau on average.
    assert forwards >= 2 and tau == pytest.approx((new - 1) / (forwards - 1), abs=0.006)
    # The shipped drafter had drafts accepted: more than one token per verification.
    assert 0 < accepted <= drafted and tau > 1.0, proc.stdout
    assert 0.0 < stages <= 3.0, proc.stdout  # S_max is at most the default 3
