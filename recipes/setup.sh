#!/usr/bin/env bash
# Set up ./.venv with nmt and its test dependencies. Safe to run again: it only adds what is missing.
#
# torch: if the venv has none, installs ${TORCH_SPEC:-torch==2.13.0}. On a GPU machine install the
# CUDA build of torch you want into .venv first (or set TORCH_SPEC); this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/nmt --version
