"""How many checkpoints `nmt average --last N` finds and what share of training they span, for the
WMT14 en-de recipes (base: the last 5 of 100k updates; big: the last 20 of 300k), at assumed speeds
given as multiples of the paper's (8 P100s: base 100k updates in 12 h, big 300k in 3.5 days, section
5.2): saving every 10 minutes as the paper did, and every `checkpoint.save_interval_updates` of the
recipe (1,400 base / 600 big). A calculation from the recipes' settings, not a measurement.

    python benchmarks/averaging_span.py [--speedups 1,2,5,10,20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt_cli.config.train import resolve_train  # noqa: E402

PAPER = {"base": (5, 12 * 3600.0), "big": (20, 3.5 * 24 * 3600.0)}  # averaged, seconds for the run


def span(saved: list[float], last: int, total: float) -> tuple[int, str]:
    """(checkpoints there are, share of training from the first averaged one to the end)."""
    if len(saved) < last:
        return len(saved), f"fails: {len(saved)} < {last}"
    return len(saved), f"{(total - saved[-last]) / total:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speedups", default="1,2,5,10,20")
    args = parser.parse_args()
    print("| model | speed (x paper) | run time | every 10 minutes: checkpoints, span of the last N | "
          "every K updates: checkpoints, span of the last N |")
    print("|---|---:|---:|---|---|")
    for name, (last, paper_seconds) in PAPER.items():
        cfg = resolve_train(REPO / f"recipes/wmt14_en_de/transformer_{name}.yaml",
                            {"data": Path("."), "save_dir": Path(".")})
        total, every = cfg.stop.max_update, cfg.checkpoint.save_interval_updates
        for speedup in map(float, args.speedups.split(",")):
            per_second = total / paper_seconds * speedup
            by_clock = [u for u in (k * 600 * per_second for k in range(1, 10**5)) if u < total] + [total]
            by_updates = [float(u) for u in range(every, total, every)] + [float(total)]
            clock_n, clock_span = span(by_clock, last, total)
            upd_n, upd_span = span(by_updates, last, total)
            hours = paper_seconds / speedup / 3600
            print(f"| {name} (last {last}) | {speedup:g} | {hours:.1f} h | {clock_n}, {clock_span} | "
                  f"{upd_n} (K={every}), {upd_span} |")


if __name__ == "__main__":
    main()
