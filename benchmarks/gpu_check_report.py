"""The table at the end of benchmarks/gpu_check.sh, from what its steps left in the working folder:
tokens/s and MFU of the resumed half of the run (its train.jsonl past a warm-up of 10 updates), the
resume, the translation's time and its sacreBLEU.

    python benchmarks/gpu_check_report.py WORK GPUS HALF UPDATES TRANSLATE_SECONDS TOTAL_SECONDS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from machine import describe


def report(work: Path, gpus: int, half: int, updates: int, translate_s: float, total_s: float) -> str:
    records = [json.loads(line) for line in (work / "run/train.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train" and r["update"] > half + 10]
    if not train:
        raise SystemExit(f"gpu_check_report: {work}/run/train.jsonl has no train record past update "
                         f"{half + 10}")
    speed = sum(r["tokens_per_second"] for r in train) / len(train)
    mfu = sum(r["mfu"] for r in train) / len(train)
    bleu = json.loads((work / "scores.json").read_text())["sacrebleu"]["score"]
    names = (", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if torch.cuda.is_available()
             else "no GPU visible to this process")
    how = "one process" if gpus == 1 else f"{gpus} torchrun workers on NCCL"
    if not torch.cuda.is_available():
        how = f"REHEARSAL ON THE CPU, {gpus} gloo worker(s), a tiny model, fp32: no GPU figure"
    return "\n".join([
        describe(),
        f"GPUs: {gpus} ({names}); torch {torch.__version__}, CUDA {torch.version.cuda}",
        "",
        "| what | figure |",
        "|---|---:|",
        f"| transformer_big, bf16, eager, {how}: target tokens/s (updates {half + 11}-{updates}) "
        f"| {speed:,.0f} |",
        f"| MFU (model FLOPs over the data-sheet peak of {gpus} GPU(s)) | {mfu:.1%} |",
        f"| resume after SIGKILL past update {half} | resumed at {half}, finished at {updates} |",
        f"| nmt translate, 500 lines of newstest2014, beam 4, cuda bf16 | {translate_s:.1f} s |",
        f"| sacreBLEU of the {updates}-update model (near zero expected: the check is that it runs) "
        f"| {bleu:.2f} |",
        f"| the whole check | {total_s:.0f} s |",
    ])


if __name__ == "__main__":
    if len(sys.argv) != 7:
        raise SystemExit(__doc__)
    work, gpus, half, updates, translate_s, total_s = sys.argv[1:]
    print(report(Path(work), int(gpus), int(half), int(updates), float(translate_s), float(total_s)))
