#!/usr/bin/env bash
# `python -m infer.device_check` on a GPU (or TPU) machine that has a stock JAX image (jax with its
# CUDA plugin, flax, optax, orbax-checkpoint, transformers, numpy) and a copy of this repository's
# tracked files, and nothing else: no virtual environment, no network, no checkpoint.
#
#   carry:    nothing beyond the tracked tree (at most 64 MiB; tests/test_device_check.py checks
#             it); the check builds random-weight targets and drafters and imports nothing
#             outside the packages above (the same test runs it with the others hidden).
#   command:  bash scripts/device_check.sh                  (from the repository root)
#             bash scripts/device_check.sh --preset tiny    (seconds: the command itself works)
#   time:     the default preset compiles about 39 programs at Qwen3-8B widths (4 of its 36
#             layers); give the command a 600 s limit. It stops itself after
#             $DEVICE_CHECK_TIMEOUT seconds (default 540), keeping the sections it finished:
#             results.json and summary.md are rewritten after every section.
#   results:  device_check_out/ in the repository (with jax_cache/: a second run on the same
#             machine loads its programs instead of compiling them); results.json and
#             summary.md are also copied to $OUT when the runner sets it, with the int8 part's
#             compiled forwards (int8_forward_w*.hlo.txt: what the GPU compiler made of them).
set -uo pipefail
cd "$(dirname "$0")/.."
out=device_check_out
mkdir -p "$out"
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout --signal=INT "${DEVICE_CHECK_TIMEOUT:-540}" python -m infer.device_check --out "$out" "$@"
status=$?
if [ -n "${OUT:-}" ]; then
  cp "$out"/results.json "$out"/summary.md "$out"/int8_forward_w*.hlo.txt "$OUT"/ 2>/dev/null
fi
[ -f "$out/summary.md" ] && cat "$out/summary.md"
exit $status
