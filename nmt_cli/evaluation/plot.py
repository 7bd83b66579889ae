"""`nmt plot`: the training curves of one or more runs, drawn from their ``train.jsonl``.

Each run's records (`training/trainlog.py`) become lines against updates (or training hours with
``--x hours``): loss and perplexity of training and validation, validation BLEU, the learning rate,
the gradient norm and the speed. Runs are overlaid in one colour each, labelled by their folder
name; training is a solid line, validation dashed with a dot per validation. The picture is PNG or
SVG by the suffix of ``--out``, drawn with matplotlib's Agg renderer (no display needed).

A log is read strictly: a line that is not a JSON record is an error naming the file and line,
except a last line cut short (no newline at its end), which is what a crash while appending
leaves; it is skipped with a warning. Records of other kinds than "train" and "valid" are ignored.
`new_figure` and `save_figure` also serve `nmt attention`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt_cli.artifacts import atomic_writer, read_text
from nmt_cli.config.evaluation import PlotConfig
from nmt_cli.errors import NmtError, shown
from nmt_cli.training.trainlog import JSONL

Warn = Callable[[str], None]
PICTURE_SUFFIXES = {".png": "png", ".svg": "svg"}


# The fields a plot reads; any others in a record are left alone.
PLOTTED = ("update", "wall_seconds", "loss", "ppl", "bleu", "lr", "gnorm", "tokens_per_second")


@dataclass
class RunLog:
    """The plotted numbers of one run's records, by kind ("train", "valid"), in record order."""

    label: str
    path: Path
    records: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {"train": [], "valid": []})


def log_path(run: Path) -> Path:
    """The train.jsonl of `run`: a --save-dir of `nmt train`, or the file itself."""
    path = Path(run)
    if path.is_dir():
        path = path / JSONL
        if not path.is_file():
            raise NmtError(f"{path.parent} holds no {JSONL}: give the --save-dir of an `nmt train` run "
                           "(it is written after the first log.interval updates)")
    elif not path.is_file():
        raise NmtError(f"{path} does not exist: give the --save-dir of an `nmt train` run or its {JSONL}")
    return path


def read_log(path: Path, warn: Warn) -> list[dict[str, Any]]:
    """The "train" and "valid" records of a train.jsonl, in order; see the module docstring."""
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise NmtError(f"cannot read {path}: {e}") from None
    lines = text.split("\n")
    torn = lines[-1] != ""  # the file does not end in a newline: its last line was being written
    records = []
    for number, line in enumerate(lines[:-1] if not torn else lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if torn and number == len(lines):
                warn(f"{path}, line {number}: skipped a last line cut short (training stopped while "
                     "writing it)")
                continue
            raise NmtError(f"{path}, line {number}: not a JSON record ({e.msg}); every line of {JSONL} "
                           "must be one JSON object as `nmt train` writes it") from None
        if record_kind(record, path, number) in ("train", "valid"):
            records.append(record)
    if not records:
        raise NmtError(f"{path} holds no training or validation records yet: train for at least "
                       "log.interval updates (or until the first validation) and plot again")
    return records


def record_kind(record: Any, path: Path, number: int) -> str | None:
    """The kind of a parsed record, after checking the fields a plot reads."""
    if not isinstance(record, dict):
        raise NmtError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind not in ("train", "valid"):
        return kind if isinstance(kind, str) else None
    if "update" not in record:
        raise NmtError(f"{path}, line {number}: a {kind} record without its 'update' number")
    for name in PLOTTED:
        value = record.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise NmtError(f"{path}, line {number}: field {shown(name)} must be a number, got {shown(value)}")
    return kind


def load_run(run: Path, label: str, warn: Warn) -> RunLog:
    path = log_path(run)
    log = RunLog(label, path)
    for record in read_log(path, warn):
        plotted = {name: float(record[name]) for name in PLOTTED if record.get(name) is not None}
        log.records[record["kind"]].append(plotted)
    return log


def run_labels(runs: tuple[Path, ...]) -> list[str]:
    """Each run's folder name, with as many parent folders as it takes to tell them apart."""
    folders = [(Path(r).parent if Path(r).suffix == ".jsonl" else Path(r)).resolve() for r in runs]
    depth = 1
    while True:
        labels = ["/".join(f.parts[-depth:]) for f in folders]
        if len(set(labels)) == len(labels) or depth >= max(len(f.parts) for f in folders):
            return labels
        depth += 1


# -- drawing ------------------------------------------------------------------------------------


def new_figure(width_inches: float, height_inches: float) -> Any:
    """A matplotlib Figure on the Agg canvas, laid out by matplotlib's constrained layout (no pyplot,
    so no global state and no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise NmtError("drawing pictures needs matplotlib: pip install 'nmt-cli[plot]'") from None
    figure = Figure(figsize=(width_inches, height_inches), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def picture_format(out: Path) -> str:
    fmt = PICTURE_SUFFIXES.get(Path(out).suffix.lower())
    if fmt is None:
        raise NmtError(f"{out}: the picture's suffix must be .png or .svg, got '{Path(out).suffix}'")
    return fmt


def save_figure(figure: Any, out: Path, dpi: int) -> None:
    """Write `figure` atomically as PNG or SVG, by the suffix of `out`."""
    fmt = picture_format(out)
    with atomic_writer(out) as f:
        figure.savefig(f, format=fmt, dpi=dpi)


# (field, title, y label, log scale); each panel draws the kinds that have the field.
PANELS = [
    ("loss", "Loss", "label-smoothed cross-entropy (nats/token)", False),
    ("ppl", "Perplexity", "perplexity exp(nll), log scale", True),
    ("bleu", "Validation BLEU", "sacreBLEU", False),
    ("lr", "Learning rate", "learning rate", False),
    ("gnorm", "Gradient norm", "L2 norm before clipping, log scale", True),
    ("tokens_per_second", "Speed", "target tokens per second", False),
]
TRAIN_STYLE = {"linestyle": "-", "linewidth": 1.4}  # training: solid
VALID_STYLE = {"linestyle": "--", "marker": "o", "markersize": 3.5, "linewidth": 1.4}  # a dot per validation


def draw(logs: list[RunLog], x_axis: str) -> Any:
    """The curves of `logs` on a 2 x 3 grid of panels (see PANELS)."""
    figure = new_figure(15.0, 8.5)
    axes = figure.subplots(2, 3).flatten()
    colors = [f"C{i % 10}" for i in range(len(logs))]
    for ax, (name, title, ylabel, log_scale) in zip(axes, PANELS, strict=True):
        drawn = False
        for log, color in zip(logs, colors, strict=True):
            for kind, style in (("train", TRAIN_STYLE), ("valid", VALID_STYLE)):
                x, y = _xy(log, kind, name, x_axis, log_scale)
                if x:
                    ax.plot(x, y, color=color, **style)
                    drawn = True
        _decorate(ax, title, ylabel, x_axis, log_scale and drawn)
        if not drawn:
            ax.text(0.5, 0.5, _missing(name), ha="center", va="center", transform=ax.transAxes, color="0.4")
    _legends(figure, axes[0], logs, colors)
    return figure


def _xy(log: RunLog, kind: str, name: str, x_axis: str, log_scale: bool) -> tuple[list[float], list[float]]:
    """The points of one line: x (updates or hours) and y from the records that have the field,
    leaving out what a log axis cannot show."""
    x_name = "update" if x_axis == "updates" else "wall_seconds"
    scale = 1.0 if x_axis == "updates" else 1 / 3600
    points = [(r[x_name] * scale, r[name]) for r in log.records[kind] if name in r and x_name in r]
    points = [(x, y) for x, y in points if math.isfinite(y) and (y > 0 or not log_scale)]
    return [x for x, _ in points], [y for _, y in points]


def _decorate(ax: Any, title: str, ylabel: str, x_axis: str, log_scale: bool) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_title(title, fontsize=12)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("update" if x_axis == "updates" else "training hours (wall clock)")
    if x_axis == "updates":  # 25000 as 25k
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _: f"{v / 1000:g}k" if abs(v) >= 1000 else f"{v:g}"))
    if log_scale:
        # plain numbers (3, 20, 500) instead of 3x10^0, on the minor ticks too when few decades show
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_plain_log_formatter())
        ax.yaxis.set_minor_formatter(_plain_log_formatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.8)))
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)


def _plain_log_formatter(**kwargs: Any) -> Any:
    """matplotlib's choice of which log-axis ticks get a label, written as plain numbers (0.7, 3, 500)."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter(**kwargs)


def _missing(name: str) -> str:
    if name == "bleu":
        return "no validation BLEU in these logs\n(train with --valid-bleu)"
    return f"no '{name}' in these logs"


def _legends(figure: Any, ax: Any, logs: list[RunLog], colors: list[str]) -> None:
    """Runs by colour (above the panels) and train/valid by line style (in the first panel)."""
    from matplotlib.lines import Line2D

    runs = [Line2D([], [], color=c, linewidth=2.5, label=log.label)
            for log, c in zip(logs, colors, strict=True)]
    figure.legend(handles=runs, loc="outside upper center", ncols=min(len(runs), 5), frameon=False,
                  fontsize=12)
    styles = [Line2D([], [], color="0.25", linestyle="-", label="train"),
              Line2D([], [], color="0.25", linestyle="--", marker="o", markersize=3.5, label="validation")]
    ax.legend(handles=styles, loc="upper right", fontsize=9)


def _stderr_warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run(cfg: PlotConfig) -> None:
    picture_format(cfg.out)  # a wrong suffix fails before anything is read
    labels = run_labels(cfg.runs)
    logs = [load_run(r, label, _stderr_warn) for r, label in zip(cfg.runs, labels, strict=True)]
    save_figure(draw(logs, cfg.x), cfg.out, cfg.dpi)
    print(f"plot: {len(logs)} run(s) -> {cfg.out}", file=sys.stderr)
