"""What `nmt train` reports, on rank 0 only: a rich progress bar on a terminal (update, loss, lr,
tokens/s, ETA), plain ``key=value`` lines otherwise, and the same numbers as one JSON object per
line in ``SAVE_DIR/train.jsonl`` (``"kind": "train"`` per log interval, ``"kind": "valid"`` per
validation), optionally mirrored to TensorBoard. `Interval` sums a log interval's updates: loss,
tokens, tokens/s and the model FLOPs utilisation ``mfu`` (flops.py).

TensorBoard (``--tensorboard-dir``) gets every number of every record as a scalar named
``KIND/FIELD`` (train/loss, train/ppl, train/lr, train/gnorm, train/tokens_per_second, valid/loss,
valid/ppl, valid/bleu, ...) at step = update. It shows what train.jsonl holds: after a resume,
train.jsonl has dropped the records of the updates that are trained again, and the event file
written next starts with a purge marker (TensorBoard's SessionLog.START at the first update not in
train.jsonl), so TensorBoard hides the old events of those updates instead of drawing them twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from nmt_cli.artifacts import atomic_write_text, read_text
from nmt_cli.errors import NmtError
from nmt_cli.training.counters import Counters
from nmt_cli.training.loss import per_token

JSONL = "train.jsonl"


class TrainLog:
    def __init__(self, save_dir: Path, enabled: bool, tensorboard_dir: Path | None = None) -> None:
        self.enabled, self.path = enabled, Path(save_dir) / JSONL
        self.console = Console(stderr=True, soft_wrap=True, highlight=False)
        self.progress: Progress | None = None
        self.task = None
        # The writer is opened with the first record, once a resume has truncated train.jsonl.
        self.tensorboard_dir = tensorboard_dir if enabled else None
        self.tensorboard = None
        self.summary_writer = _summary_writer_class() if self.tensorboard_dir is not None else None

    def start(self, first_update: int, last_update: int | None) -> None:
        """Show the progress bar (terminals only) from `first_update` towards `last_update`."""
        if not (self.enabled and self.console.is_terminal):
            return
        self.progress = Progress(
            TextColumn("update"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[speed]} tok/s"),
            TimeRemainingColumn(), console=self.console, transient=True)
        self.task = self.progress.add_task("train", total=last_update, completed=first_update,
                                           loss="-", lr="-", speed="-")
        self.progress.start()

    def step(self, update: int, loss: float, lr: float, tokens_per_second: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=update, loss=f"{loss:.3f}", lr=f"{lr:.2e}",
                                 speed=f"{tokens_per_second:,.0f}")

    def record(self, fields: dict[str, Any]) -> None:
        """One JSON line in train.jsonl and one ``key=value`` line in the log."""
        if not self.enabled:
            return
        if self.summary_writer is not None and self.tensorboard is None:
            purge_from = last_update(self.path) + 1  # events from here on are not in train.jsonl (any more)
            self.tensorboard = self.summary_writer(str(self.tensorboard_dir), purge_step=purge_from)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")
        self.info(" ".join(f"{k}={_show(v)}" for k, v in fields.items()))
        if self.tensorboard is not None:
            prefix = fields.get("kind", "train")
            for key, value in fields.items():
                if (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and key not in ("update", "kind")):
                    self.tensorboard.add_scalar(f"{prefix}/{key}", value, fields["update"])

    def info(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False)

    def warn(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[yellow]warning:[/] {text}", soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.tensorboard is not None:
            self.tensorboard.close()


def truncate_after(path: Path, update: int) -> None:
    """Drop the records of updates after `update` (they are trained again after a resume)."""
    if not path.exists():
        return
    kept = []
    for line in read_text(path).splitlines():
        try:
            if json.loads(line).get("update", 0) <= update:
                kept.append(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


def last_update(path: Path) -> int:
    """The highest update of the records in `path` (0 when there are none)."""
    if not path.exists():
        return 0
    last = 0
    for line in read_text(path).splitlines():
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            last = max(last, int(json.loads(line).get("update", 0)))
    return last


def _show(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6) and math.isfinite(value):
            return f"{value:.3e}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _summary_writer_class() -> Any:
    """torch's SummaryWriter, imported before training starts so that a missing package stops it early."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise NmtError("--tensorboard-dir needs the tensorboard package: pip install 'nmt-cli[tensorboard]' "
                       "(or train without --tensorboard-dir)") from None
    return SummaryWriter


class Interval:
    """Sums over the updates since the last log line."""

    def __init__(self, flops_of: Callable[[float, float, float], float], peak: float) -> None:
        self.flops_of, self.peak = flops_of, peak  # FLOPs of (source, target tokens, sentences); all devices
        self.reset()

    def reset(self, sums: dict[str, float] | None = None) -> None:
        self.values = dict.fromkeys(("loss", "nll", "tgt", "src", "sentences", "gnorm", "updates", "skipped",
                                     "oom"), 0.0)
        self.values.update(sums or {})
        self.clock, self.clock_tgt, self.last_loss, self.last_lr = time.monotonic(), 0.0, 0.0, 0.0
        self.clock_flops = 0.0

    def add(self, totals: Sequence[float] | None, gnorm: float, lr: float, oom_micro_batches: int) -> None:
        """One update's sums over all ranks (`step.Totals.trained`), or None for a skipped update."""
        self.values["oom"] += oom_micro_batches
        if totals is None:
            self.values["skipped"] += 1
            return
        sums = dict(zip(("loss", "nll", "tgt", "src", "sentences"), totals, strict=True))
        for key, value in sums.items():
            self.values[key] += value
        self.values["gnorm"] += gnorm
        self.values["updates"] += 1
        self.clock_tgt += sums["tgt"]
        self.clock_flops += self.flops_of(sums["src"], sums["tgt"], sums["sentences"])
        self.last_loss, self.last_lr = per_token(sums["loss"], int(sums["tgt"])), lr

    @property
    def updates(self) -> int:
        return int(self.values["updates"])

    def speed(self) -> float:
        return self.clock_tgt / max(time.monotonic() - self.clock, 1e-9)

    def mfu(self) -> float:
        """Model FLOPs utilisation since the last log line: the model's FLOPs per second over the
        devices' peak."""
        return self.clock_flops / max(time.monotonic() - self.clock, 1e-9) / self.peak

    def sums(self) -> dict[str, float]:
        return dict(self.values)

    def record(self, c: Counters) -> dict[str, Any]:
        v, n = self.values, max(self.updates, 1)
        nll = per_token(v["nll"], int(v["tgt"]))
        return {"kind": "train", "update": c.update, "epoch": c.epoch,
                "loss": round(per_token(v["loss"], int(v["tgt"])), 6),
                "nll": round(nll, 6), "ppl": round(math.exp(min(nll, 50.0)), 4), "lr": self.last_lr,
                "gnorm": round(v["gnorm"] / n, 6),
                "src_tokens": round(v["src"] / n), "tgt_tokens": round(v["tgt"] / n),
                "sentences": round(v["sentences"] / n), "updates": self.updates,
                "skipped_updates": int(v["skipped"]), "oom_micro_batches": int(v["oom"]),
                "tokens_per_second": round(self.speed(), 1), "mfu": round(self.mfu(), 5),
                "wall_seconds": round(c.train_seconds, 3)}
