#!/usr/bin/env bash
# WMT14 English-German with the Transformer (paper: base 27.3, big 28.4 BLEU). See README.md here.
#   bash recipes/wmt14_en_de/run.sh --model big --gpus 8
PAIR=en-de VOCAB=37000 exec bash "$(dirname "$0")/../wmt14.sh" "$@"
