#!/usr/bin/env bash
# SmolLM2-135M-Instruct drafters from the 10k-prompt dataset, rebuilding whatever is missing and
# resuming whatever was stopped (rerun the same command after any stop):
#
#   1. the dataset: `python -m train.data --config configs/data_smollm2.py:10k` (resumable chunks;
#      a finished dataset is reused). The target's answers ship in data/responses, so a fresh
#      machine computes only their features (one forward pass each) and answers only what the
#      store lacks;
#   2. for every data size in SIZES and every drafter kind in KINDS: the `cpu10k` run on the first
#      SIZE examples, then its loop-aware fine-tune (`cpu10k_loop`); each resumes from its Orbax
#      checkpoints, measures engine tau every few hundred steps and keeps its best step in
#      RUNS/<kind>_<size>[_loop]/best.
#
# Usage: bash scripts/smollm2_drafters.sh [DATA_DIR] [RUNS_DIR]
#   DATA_DIR  the TFDS data directory (default: $DLOOP_DATA_DIR, else ~/.cache/dloop_jax/datasets)
#   RUNS_DIR  where the runs go (default: runs/smollm2_10k)
# Environment: SIZES ("1000 3000 all", the data-scaling curve; default "all"), KINDS (default
# "eagle3 block"; also dspark, domino: configs/smollm2_<kind>.py), TOPK (the target's top-k next
# tokens stored in the dataset: default 16 when KINDS holds dspark, else 0), PYTHON (default
# .venv/bin/python), LOOP (1: each run's loop-aware fine-tune follows it; 0: base runs only),
# TRAIN_ARGS: more flags for every
# `python -m train` (e.g. "--config.eval.every_steps=0"; soft targets, which need TOPK > 0:
# TOPK=16 TRAIN_ARGS="--config.objective_cfg.kl_weight=1 --config.objective_cfg.hard_weight=0.1"),
# and DATASET: a built dataset to train on instead of building the 10k one (e.g. a `--snapshot`
# of a running build).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
DATA_DIR=${1:-${DLOOP_DATA_DIR:-$HOME/.cache/dloop_jax/datasets}}
RUNS=${2:-runs/smollm2_10k}
SIZES=${SIZES:-all}
KINDS=${KINDS:-eagle3 block}
mkdir -p "$RUNS"

# DSpark learns from the target's distributions: with it among the kinds, the one dataset all
# kinds train on also stores the target's top-16 next tokens per position.
if [[ -z "${TOPK:-}" ]]; then
  TOPK=0
  if [[ " $KINDS " == *" dspark "* ]]; then TOPK=16; fi
fi

if [[ -z "${DATASET:-}" ]]; then
  echo "== dataset (configs/data_smollm2.py:10k, target_topk=$TOPK) in $DATA_DIR"
  "$PYTHON" -m train.data --config configs/data_smollm2.py:10k --data_dir "$DATA_DIR" \
    --config.target_responses.target_topk="$TOPK" | tee "$RUNS/data.log"
  DATASET=$(sed -n 's/.*--config\.data\.path=//p' "$RUNS/data.log" | tail -1)
  if [[ -z "$DATASET" ]]; then
    echo "error: the data build did not report its dataset directory (see $RUNS/data.log)" >&2
    exit 2
  fi
fi
echo "== training on $DATASET"

for size in $SIZES; do
  if [[ "$size" == all ]]; then examples=0; else examples=$size; fi
  for kind in $KINDS; do
    base="$RUNS/${kind}_${size}"
    echo "== $kind on $size examples: $base"
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
    "$PYTHON" -m train --config "configs/smollm2_${kind}.py:cpu10k" --workdir "$base" \
      --config.data.path="$DATASET" --config.data.max_examples="$examples" \
      --config.eval.data_dir="$DATA_DIR" ${TRAIN_ARGS:-}
    if [[ "${LOOP:-1}" == 0 ]]; then continue; fi
    # The fine-tune starts from the best step by engine tau (the newest one without evaluations).
    init="$base/best"
    [[ -f "$init/drafter.json" ]] || init="$base"
    echo "== $kind on $size examples, loop-aware fine-tune: ${base}_loop"
    # shellcheck disable=SC2086
    "$PYTHON" -m train --config "configs/smollm2_${kind}.py:cpu10k_loop" --workdir "${base}_loop" \
      --config.data.path="$DATASET" --config.data.max_examples="$examples" \
      --config.eval.data_dir="$DATA_DIR" --config.init_from="$init" ${TRAIN_ARGS:-}
  done
done
echo "== done: best drafters in $RUNS/*/best (load_drafter(DIR, target=...), python -m infer --drafter DIR)"
