#!/usr/bin/env bash
# Table 3 of "Attention Is All You Need" (model variations, English-German, newstest2013): trains the
# rows you name (all 20 by default) with the base recipe's data, schedule and GPUs, each in
# WORK/table3/ROW, evaluates each as the paper did and writes WORK/table3/table3.md. Rerun to resume;
# finished rows are skipped. See table3.py (or --help) for the options.
#   bash recipes/wmt14_en_de/table3.sh --gpus 8 [--rows "base A-h1 E-learned"]
#   bash recipes/wmt14_en_de/table3.sh --smoke          # every row for two updates on the CPU
exec "${PYTHON:-python3}" "$(dirname "$0")/table3.py" "$@"
