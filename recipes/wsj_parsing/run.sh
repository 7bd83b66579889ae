#!/usr/bin/env bash
# English constituency parsing, WSJ only (arXiv 1706.03762, section 6.3: 91.3 F1 on section 23).
# prepare -> bpe -> binarize -> train -> average -> translate (trees) -> score (EVALB). See README.md.
#   bash recipes/wsj_parsing/run.sh --treebank /data/LDC99T42/treebank_3/parsed/mrg/wsj --gpus 8
set -euo pipefail

usage() {
    cat <<EOF
usage: run.sh --treebank DIR [--split-files SPEC] [--gpus N] [--work DIR] [--stage N] [--until N]
              [--nproc N] [--smoke] [-- EXTRA TRAIN OPTIONS]

  --treebank    the Penn Treebank (LDC99T42): its parsed/mrg/wsj folder or any folder holding the
                wsj_NNNN.mrg files (licensed by the LDC: it cannot be downloaded)
  --split-files the files of each split, e.g. train=1-79,valid=80-89,test=90-99
                [the standard split: sections 02-21, 22, 23]
  --gpus        GPUs on this machine, one torchrun worker each [8]
  --work        folder for data, checkpoints and results [work/wsj_parsing]
  --stage       start at stage N: 1 prepare, 2 bpe, 3 binarize, 4 train, 5 average,
                6 translate, 7 score [1]
  --until       stop after stage N [7]
  --nproc       N CPU workers (gloo) instead of GPUs
  --smoke       every stage on the CPU in a minute (a tiny model, a few updates); without
                --treebank on a tiny treebank written into WORK: checks the recipe, its F1 means nothing
  after --      options passed on to 'nmt train' (e.g. --set stop.max_update=20000)
EOF
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TREEBANK="" SPLIT_FILES="" GPUS=8 WORK=work/wsj_parsing STAGE=1 UNTIL=7 SMOKE=0 NPROC=0
VOCAB=16000 LAST=5 TRAIN_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --treebank) TREEBANK=$2; shift 2 ;;
        --split-files) SPLIT_FILES=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        --stage) STAGE=$2; shift 2 ;;
        --until) UNTIL=$2; shift 2 ;;
        --nproc) NPROC=$2; shift 2 ;;
        --smoke) SMOKE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; TRAIN_ARGS+=("$@"); break ;;
        *) echo "run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

NMT=${NMT:-nmt}
DEVICES=(--gpus "$GPUS")
[ "$NPROC" -gt 0 ] && DEVICES=(--nproc "$NPROC" --device cpu)
if [ "$SMOKE" = 1 ]; then
    VOCAB=${SMOKE_VOCAB:-150}
    LAST=2
    DEVICES=(--device cpu)
    [ "$NPROC" -gt 0 ] && DEVICES=(--nproc "$NPROC" --device cpu)
    TRAIN_ARGS=(--arch transformer_tiny --max-update 4 --tokens-per-update 1000 --max-tokens 1000
                --save-interval-updates 2 --precision fp32 --set valid.interval_updates=2
                --set log.interval=1 "${TRAIN_ARGS[@]}")
    if [ -z "$TREEBANK" ]; then
        TREEBANK="$WORK/smoke-treebank" SPLIT_FILES="train=1-3,valid=4,test=5"
        bash "$HERE/tiny_treebank.sh" "$TREEBANK"
    fi
fi
if [ -z "$TREEBANK" ] && [ "$STAGE" -le 1 ]; then
    echo "run.sh: give --treebank DIR (the Penn Treebank, LDC99T42), or --smoke" >&2
    exit 2
fi
SPLIT_ARGS=()
[ -n "$SPLIT_FILES" ] && SPLIT_ARGS=(--split-files "$SPLIT_FILES")
CKPT="$WORK/parse"
step() { [ "$STAGE" -le "$1" ] && [ "$1" -le "$UNTIL" ] && echo "== stage $1: $2"; }

if step 1 "prepare (words -> linearised trees)"; then
    $NMT prepare ptb --treebank "$TREEBANK" --out "$WORK/raw" "${SPLIT_ARGS[@]}"
fi
if step 2 "bpe (joint sentencepiece, $VOCAB)"; then
    $NMT bpe "$WORK/raw" --out "$WORK/bpe" --vocab-size "$VOCAB"
fi
if step 3 binarize; then
    $NMT binarize "$WORK/bpe" --out "$WORK/bin"
fi
if step 4 "train transformer_parse"; then
    $NMT train "$WORK/bin" --config "$HERE/transformer_parse.yaml" --save-dir "$CKPT" \
        "${DEVICES[@]}" "${TRAIN_ARGS[@]}"
fi
if step 5 "average the last $LAST checkpoints"; then
    $NMT average "$CKPT" --last "$LAST" --out "$CKPT/averaged.pt"
fi
if step 6 "parse the test split (beam 21, alpha 0.3, max length source+300)"; then
    $NMT translate "$CKPT/averaged.pt" --input "$WORK/raw/test.en" --output "$CKPT/test.trees" \
        --output-format tree --beam 21 --lenpen 0.3 --set max_len_a=1 --set max_len_b=300
fi
if step 7 "score (EVALB, COLLINS.prm)"; then
    $NMT score --task parse --hyp "$CKPT/test.trees" --ref "$WORK/raw/test.trees" \
        --json "$CKPT/test.scores.json"
fi
