#!/usr/bin/env bash
# The whole pipeline on the CPU in a few minutes, offline: the generated toy corpus (English ->
# Toylang), a tiny Transformer, all seven stages, ending in a score table.
#   bash recipes/quickstart.sh [WORK_DIR]        (default: runs/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-runs/quickstart}

bash recipes/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

nmt prepare toy --out "$WORK/raw"
nmt bpe "$WORK/raw" --out "$WORK/bpe" --vocab-size 1000
nmt binarize "$WORK/bpe" --out "$WORK/bin"
nmt train "$WORK/bin" --config recipes/quickstart.yaml --save-dir "$WORK/checkpoints"
nmt average "$WORK/checkpoints" --last 5 --out "$WORK/model.pt"
nmt translate "$WORK/model.pt" --input "$WORK/raw/test.en" --output "$WORK/test.hyp.ty"
nmt score --hyp "$WORK/test.hyp.ty" --ref "$WORK/raw/test.ty" --json "$WORK/scores.json"
