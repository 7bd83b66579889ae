#!/usr/bin/env bash
# The shared WMT14 en-de text as a binarized folder with the lengths of a real run: the 10k-pair
# training sample (train), newstest2013 (valid) and newstest2014 (test), through nmt prepare, bpe
# (8000 pieces: the sample is too small for the paper's 37000) and binarize. About a minute on 2 cores.
#
#   bash benchmarks/wmt_sample.sh OUT_DIR     -> OUT_DIR/raw, OUT_DIR/bpe, OUT_DIR/bin
#
# Environment: PYTHON (default .venv/bin/python, else python3), NMT_SHARED_DATA (default
# ../shared/data beside the repository). Does nothing for a folder already built.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)

if [ $# -ne 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    [ $# -eq 1 ] && exit 0 || exit 2
fi
OUT=$1
PYTHON=${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}
DATA=${NMT_SHARED_DATA:-$REPO/../shared/data}
for f in wmt-train-sample-10k/train.en wmt13-newstest2013/en-de/newstest2013.de \
         wmt14-newstest2014/en-de/newstest2014.de; do
    if [ ! -f "$DATA/$f" ]; then
        echo "wmt_sample.sh: $DATA/$f not found; set NMT_SHARED_DATA to the shared/data folder" >&2
        exit 2
    fi
done
if [ -f "$OUT/bin/manifest.json" ]; then
    exit 0
fi
nmt() { (cd "$REPO" && "$PYTHON" -m nmt_cli "$@"); }
rm -rf "$OUT/raw" "$OUT/bpe" "$OUT/bin"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
nmt prepare local --src-lang en --tgt-lang de --out "$OUT/raw" \
    --train="$DATA/wmt-train-sample-10k/train" --valid="$DATA/wmt13-newstest2013/en-de/newstest2013" \
    --test="$DATA/wmt14-newstest2014/en-de/newstest2014" >&2
nmt bpe "$OUT/raw" --out "$OUT/bpe" --vocab-size 8000 >&2
nmt binarize "$OUT/bpe" --out "$OUT/bin" >&2
