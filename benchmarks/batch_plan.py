"""The planned target tokens per update on 1 to 64 devices, as `nmt train --dry-run` prints them, for
a recipe (default: WMT14 en-de big: tokens_per_update 25000, max_tokens 4096) on the lengths of the
shared WMT sample (benchmarks/wmt_sample.sh builds it), beside what the planner before issue 16 gave
(the nearest number of micro-batches of max_tokens, at least one).

    python benchmarks/batch_plan.py [--work DIR] [--config YAML] [--devices 1,2,4,8,16,64]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt_cli.config.train import resolve_train  # noqa: E402
from nmt_cli.training import corpus  # noqa: E402


def dry_run(data: Path, config: Path, devices: int) -> str:
    proc = subprocess.run([sys.executable, "-m", "nmt_cli", "train", str(data), "--save-dir", "/nonexistent",
                           "--config", str(config), "--gpus", str(devices), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, check=True)
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nmt-wmt-sample")
    parser.add_argument("--config", type=Path, default=REPO / "recipes/wmt14_en_de/transformer_big.yaml")
    parser.add_argument("--devices", default="1,2,4,8,16,64")
    args = parser.parse_args()
    subprocess.run(["bash", str(REPO / "benchmarks/wmt_sample.sh"), str(args.work)], check=True)
    data = args.work / "bin"
    cfg = resolve_train(args.config, {"data": data, "save_dir": Path("/nonexistent")})
    one = corpus.load(cfg, 1).train
    mean_full = float(corpus.plan_split(one.src, one.tgt, cfg.model.max_positions,
                                        cfg.batch.max_tokens).tgt_tokens.mean())
    print(describe())
    print(f"recipe {args.config.relative_to(REPO)}: tokens_per_update {cfg.batch.tokens_per_update:,}, "
          f"max_tokens {cfg.batch.max_tokens:,}; data {data} ({len(one.src):,} training pairs)\n")
    print("| devices | micro-batches per device | micro-batch budget | planned target tokens per update "
          "| vs 25,000 | before issue 16 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for devices in map(int, args.devices.split(",")):
        out = dry_run(data, args.config, devices)
        M = int(re.search(r"accumulation: (\d+) micro-batch", out).group(1))
        planned = float(re.search(r"; ([\d,]+) real target tokens planned", out).group(1).replace(",", ""))
        budget = re.search(r"lowered from [\d,]+ to ([\d,]+) tokens", out)
        old_m = max(1, round(cfg.batch.tokens_per_update / (devices * mean_full)))
        old = devices * old_m * mean_full
        ask = cfg.batch.tokens_per_update
        print(f"| {devices} | {M} | {budget.group(1) if budget else f'{cfg.batch.max_tokens:,}'} | "
              f"{planned:,.0f} | {planned / ask - 1:+.1%} | {old:,.0f} ({old / ask - 1:+.1%}) |")


if __name__ == "__main__":
    main()
