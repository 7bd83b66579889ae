#!/usr/bin/env bash
# WMT14 English-French with the Transformer (paper: base 38.1, big 41.8 BLEU). See README.md here.
#   bash recipes/wmt14_en_fr/run.sh --model big --gpus 8
PAIR=en-fr VOCAB=32000 exec bash "$(dirname "$0")/../wmt14.sh" "$@"
