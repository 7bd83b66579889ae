#!/usr/bin/env bash
# The GPU check: what `nmt train --gpus N` does on CUDA GPUs, in under 8 minutes on one.
#
#   bash benchmarks/gpu_check.sh [--gpus N] [--updates U] [--work DIR] [--keep]
#
#   --gpus N      GPUs to train on (default: every GPU torch sees)
#   --updates U   training updates (default 200; the run is killed after U/2 and resumed)
#   --work DIR    working folder (default: a new temporary folder, removed at the end unless --keep)
#   --keep        keep the working folder
#
# Steps: (1) the shared WMT14 en-de sample as a binarized folder (benchmarks/wmt_sample.sh: WMT-like
# sentence lengths); (2) the dry run with the largest batch tried on GPU 0; (3) transformer_big on
# NCCL in bf16 with the recipe's batch (25000 target tokens per update, max_tokens 4096), eager, a
# numbered checkpoint every U/2 updates: killed (the whole process group, SIGKILL) once the first
# one is written, then the same command again, which must resume from it and finish; (4) nmt
# translate of newstest2014 (first 500 lines) on cuda in bf16, and nmt score. It ends with a table:
# tokens/s and MFU of the resumed half (from train.jsonl), the resume, translation speed and BLEU
# (a model 200 updates old: near zero; the check is that it runs). Environment: PYTHON (default
# .venv/bin/python, else python3), NMT_SHARED_DATA (default ../shared/data); GPU_CHECK_REHEARSAL=1
# runs every step on the CPU instead (gloo workers, a tiny fp32 model): a test of this script only.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
fail() { echo "gpu_check: $*" >&2; exit 2; }

GPUS="" UPDATES=200 WORK="" KEEP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --gpus) [ $# -ge 2 ] || fail "--gpus needs a number"; GPUS=$2; shift 2 ;;
        --updates) [ $# -ge 2 ] || fail "--updates needs a number"; UPDATES=$2; shift 2 ;;
        --work) [ $# -ge 2 ] || fail "--work needs a folder"; WORK=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; fail "unknown argument '$1'" ;;
    esac
done
[[ "$UPDATES" =~ ^[0-9]+$ ]] && [ "$UPDATES" -ge 4 ] || fail "--updates must be a whole number of at least 4"
[ -z "$GPUS" ] || { [[ "$GPUS" =~ ^[0-9]+$ ]] && [ "$GPUS" -ge 1 ]; } || fail "--gpus must be a whole number >= 1"

# Refuse before anything else when torch sees no CUDA GPU.
VISIBLE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)") \
    || fail "cannot import torch with $PYTHON; run bash recipes/setup.sh (with a CUDA torch) first"
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
if [ "$REHEARSAL" = 1 ]; then
    echo "gpu_check: REHEARSAL on the CPU (GPU_CHECK_REHEARSAL=1): no figure below is a GPU's" >&2
    VISIBLE=${GPUS:-2}
    DEVICE=(--nproc "$VISIBLE" --precision fp32 --set model.d_model=64 --set model.d_ff=128 --set model.heads=2
            --set model.encoder_layers=1 --set model.decoder_layers=1 --tokens-per-update 3000
            --max-tokens 1500 --set threads=1)
    ON_CUDA=(--device cpu --dtype fp32 --threads 1)
elif [ "$VISIBLE" -eq 0 ]; then
    TORCH=$("$PYTHON" -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda or 'none')")
    fail "no CUDA GPU is visible to torch ($TORCH): this check runs only on a machine with one or more \
NVIDIA GPUs and a CUDA build of torch. Nothing was run."
fi
GPUS=${GPUS:-$VISIBLE}
[ "$REHEARSAL" = 1 ] || { DEVICE=(--gpus "$GPUS" --precision bf16); ON_CUDA=(--device cuda --dtype bf16); }
[ "$GPUS" -le "$VISIBLE" ] || fail "--gpus $GPUS asked for, but torch sees $VISIBLE GPU(s)"

if [ -z "$WORK" ]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/nmt-gpu-check.XXXXXX")
    [ "$KEEP" -eq 1 ] || trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
nmt() { (cd "$REPO" && "$PYTHON" -m nmt_cli "$@"); }
START=$(date +%s)
say() { echo "== [$(( $(date +%s) - START ))s] $*" >&2; }

say "1. data: the shared WMT sample, binarized ($WORK/data)"
PYTHON=$PYTHON bash "$REPO/benchmarks/wmt_sample.sh" "$WORK/data"
DATA=$WORK/data/bin SAVE=$WORK/run HALF=$(( UPDATES / 2 ))
TRAIN=(train "$DATA" --save-dir "$SAVE" --config "$REPO/recipes/wmt14_en_de/transformer_big.yaml"
       "${DEVICE[@]}" --max-update "$UPDATES" --save-interval-updates "$HALF"
       --save-interval-minutes 0 --set log.interval=10 --set valid.interval_updates=0)

say "2. dry run on $GPUS GPU(s), the largest batch tried on GPU 0"
nmt "${TRAIN[@]}" --dry-run $([ "$REHEARSAL" = 1 ] || echo --try-largest-batch) | tee "$WORK/plan.txt" >&2

say "3a. train transformer_big to update $HALF's checkpoint, then kill every process of the run"
rm -rf "$SAVE"
set -m  # job control: the run gets a process group of its own (torchrun and its workers), killed whole
( cd "$REPO" && exec "$PYTHON" -m nmt_cli "${TRAIN[@]}" ) > "$WORK/train1.log" 2>&1 &
RUN=$!
set +m
until [ -f "$SAVE/checkpoint_$HALF.pt" ] && [ -f "$SAVE/checkpoint_last.pt" ]; do
    if ! kill -0 "$RUN" 2>/dev/null; then
        cat "$WORK/train1.log" >&2; fail "training ended before its checkpoint at update $HALF"
    fi
    sleep 1
done
sleep 5  # a few updates past the checkpoint, which the resume must train again
kill -0 "$RUN" 2>/dev/null || fail "the run finished before it could be killed; give more --updates"
kill -KILL -- "-$RUN" 2>/dev/null || true
wait "$RUN" 2>/dev/null || true
grep -E "kind=train|saved|peak_tflops" "$WORK/train1.log" >&2 || true

say "3b. the same command again: resume from update $HALF and finish"
nmt "${TRAIN[@]}" > "$WORK/train2.log" 2>&1 || { cat "$WORK/train2.log" >&2; fail "the resumed run failed"; }
grep -E "resuming|kind=train|saved" "$WORK/train2.log" >&2 || true
grep -q "resuming from .* at update $HALF " "$WORK/train2.log" || fail "the second run did not resume at $HALF"
[ -f "$SAVE/checkpoint_$UPDATES.pt" ] || fail "no checkpoint_$UPDATES.pt after the resumed run"

say "4. translate newstest2014 (500 lines) on cuda in bf16, then score"
head -n 500 "$WORK/data/raw/test.en" > "$WORK/test.en"
head -n 500 "$WORK/data/raw/test.de" > "$WORK/test.de"
T0=$(date +%s%N)
nmt translate "$SAVE/checkpoint_$UPDATES.pt" --input "$WORK/test.en" --output "$WORK/hyp.de" \
    "${ON_CUDA[@]}" --beam 4 > "$WORK/translate.log" 2>&1 \
    || { cat "$WORK/translate.log" >&2; fail "translation on cuda failed"; }
T1=$(date +%s%N)
[ "$(wc -l < "$WORK/hyp.de")" -eq 500 ] || fail "the translation does not have 500 lines"
nmt score --hyp "$WORK/hyp.de" --ref "$WORK/test.de" --json "$WORK/scores.json" > "$WORK/score.log" 2>&1 \
    || { cat "$WORK/score.log" >&2; fail "scoring failed"; }

T2=$(date +%s)
"$PYTHON" "$REPO/benchmarks/gpu_check_report.py" "$WORK" "$GPUS" "$HALF" "$UPDATES" \
    "$(( (T1 - T0) / 1000000 ))e-3" "$(( T2 - START ))"
