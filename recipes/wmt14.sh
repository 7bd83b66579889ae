#!/usr/bin/env bash
# The WMT14 recipe shared by recipes/wmt14_en_de/run.sh and recipes/wmt14_en_fr/run.sh:
# prepare -> bpe -> binarize -> train -> average -> translate -> score, with the paper's settings.
#
# Stages that already finished are skipped: prepare/bpe/binarize see their own manifest.json,
# train resumes from checkpoint_last.pt (and stops at once when it has reached max_update).
set -euo pipefail

usage() {
    cat <<EOF
usage: run.sh [--model base|big] [--gpus N] [--work DIR] [--stage N] [--until N]
              [--from DIR | --mirror URL] [--checksums FILE] [--nproc N]
              [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT] [--smoke] [-- EXTRA TRAIN OPTIONS]

  --model       base (100k updates, average last 5) or big (300k updates, average last 20) [big]
  --gpus        GPUs on this machine, one torchrun worker each [8]
  --work        folder for data, checkpoints and results [work/wmt14_PAIR]
  --stage       start at stage N: 1 prepare, 2 bpe, 3 binarize, 4 train, 5 average,
                6 translate, 7 score [1]
  --until       stop after stage N [7]
  --from        folder with the already-downloaded WMT14 archives (no network)
  --mirror      base URL of a mirror of statmt.org
  --checksums   file of 'sha256-or-md5  archive-name' lines replacing the built-in checksums
  --nproc       N CPU workers (gloo) instead of GPUs: for trying the recipe without GPUs
  --nnodes, --node-rank, --rdzv-endpoint
                several machines: run the same command on each, with its own --node-rank
  --smoke       a minutes-long run of every stage on the CPU (tiny model, a few updates, validated
                on 4 batches, the first 100 test sentences): checks the recipe end to end; its BLEU
                and perplexity mean nothing
  after --       options passed on to 'nmt train' (e.g. --set stop.max_update=50000)
EOF
}

PAIR=${PAIR:?set by run.sh}
SRC=${PAIR%-*}
TGT=${PAIR#*-}
VOCAB=${VOCAB:?set by run.sh}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECIPE="$HERE/wmt14_${SRC}_${TGT}"

MODEL=big GPUS=8 WORK="work/wmt14_${SRC}_${TGT}" STAGE=1 UNTIL=7 SMOKE=0 NPROC=0
PREPARE_ARGS=() TRAIN_ARGS=() NODE_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        --stage) STAGE=$2; shift 2 ;;
        --until) UNTIL=$2; shift 2 ;;
        --from) PREPARE_ARGS+=(--from "$2"); shift 2 ;;
        --mirror) PREPARE_ARGS+=(--mirror "$2"); shift 2 ;;
        --checksums) PREPARE_ARGS+=(--checksums "$2"); shift 2 ;;
        --nproc) NPROC=$2; shift 2 ;;
        --nnodes|--node-rank|--rdzv-endpoint) NODE_ARGS+=("$1" "$2"); shift 2 ;;
        --smoke) SMOKE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; TRAIN_ARGS+=("$@"); break ;;
        *) echo "run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$MODEL" in
    base) LAST=5 ;;
    big) LAST=20 ;;
    *) echo "run.sh: --model must be base or big, not '$MODEL'" >&2; exit 2 ;;
esac

NMT=${NMT:-nmt}
DEVICES=(--gpus "$GPUS")
[ "$NPROC" -gt 0 ] && DEVICES=(--nproc "$NPROC" --device cpu)
if [ "$SMOKE" = 1 ]; then
    # Every stage for real, sized for a CPU: a small vocabulary, a tiny model, a few updates, each
    # validation on 4 batches (all of newstest2013 takes minutes on a CPU; a smoke run validates 4 times).
    VOCAB=${SMOKE_VOCAB:-500}
    LAST=2
    TRAIN_ARGS=(--arch transformer_tiny --max-update 6 --tokens-per-update 2000 --max-tokens 1000
                --save-interval-updates 2 --precision fp32 --set valid.interval_updates=3
                --set valid.max_batches=4 --set log.interval=1 "${TRAIN_ARGS[@]}")
fi
CKPT="$WORK/$MODEL"
TEST_SRC="$WORK/raw/test.$SRC" TEST_REF="$WORK/raw/test.$TGT"
if [ "$SMOKE" = 1 ]; then
    TEST_SRC="$CKPT/smoke-test.$SRC" TEST_REF="$CKPT/smoke-test.$TGT"
fi
step() { [ "$STAGE" -le "$1" ] && [ "$1" -le "$UNTIL" ] && echo "== stage $1: $2"; }

if step 1 prepare; then
    $NMT prepare "wmt14-$SRC-$TGT" --src-lang "$SRC" --tgt-lang "$TGT" --out "$WORK/raw" "${PREPARE_ARGS[@]}"
fi
if step 2 "bpe (joint sentencepiece, $VOCAB)"; then
    $NMT bpe "$WORK/raw" --out "$WORK/bpe" --vocab-size "$VOCAB"
fi
if step 3 binarize; then
    $NMT binarize "$WORK/bpe" --out "$WORK/bin"
fi
if step 4 "train transformer_$MODEL"; then
    $NMT train "$WORK/bin" --config "$RECIPE/transformer_$MODEL.yaml" --save-dir "$CKPT" \
        "${DEVICES[@]}" "${NODE_ARGS[@]}" "${TRAIN_ARGS[@]}"
fi
# Only the first machine averages, translates and scores.
NODE_RANK=0
for ((i = 0; i < ${#NODE_ARGS[@]}; i += 2)); do
    [ "${NODE_ARGS[i]}" = --node-rank ] && NODE_RANK=${NODE_ARGS[i + 1]}
done
[ "$NODE_RANK" = 0 ] || exit 0
if step 5 "average the last $LAST checkpoints"; then
    $NMT average "$CKPT" --last "$LAST" --out "$CKPT/averaged.pt"
fi
if step 6 "translate newstest2014 (beam 4, alpha 0.6, max length source+50)"; then
    if [ "$SMOKE" = 1 ]; then
        head -n 100 "$WORK/raw/test.$SRC" > "$TEST_SRC"
        head -n 100 "$WORK/raw/test.$TGT" > "$TEST_REF"
    fi
    $NMT translate "$CKPT/averaged.pt" --input "$TEST_SRC" --output "$CKPT/newstest2014.$TGT" \
        --beam 4 --lenpen 0.6 --set max_len_a=1 --set max_len_b=50
fi
if step 7 score; then
    $NMT score --hyp "$CKPT/newstest2014.$TGT" --ref "$TEST_REF" --langpair "$SRC-$TGT" \
        --json "$CKPT/newstest2014.scores.json"
fi
