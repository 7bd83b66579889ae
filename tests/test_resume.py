"""Kill `nmt train` anywhere, run the same command again, and it ends exactly where an uninterrupted
run ends: the same weights, optimiser state and logged losses (fp32 on the CPU), having lost at most
one checkpoint interval per kill. Also when torchrun restarts a worker group after one worker died."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_TRAIN, nmt
from nmt_cli.config.core import flatten, to_dict
from nmt_cli.config.train import TrainConfig, train_base
from nmt_cli.model import file as model_file
from nmt_cli.training import checkpoint
from nmt_cli.training.checkpoint import BEST, LAST
from nmt_cli.training.resume import _changed_settings, stored_settings

SAVE_EVERY = 3
# 4 updates per epoch (8 batches, 2 per update), a checkpoint every 3 updates, a log line every 2: the
# kills land mid-epoch, mid-log-interval and at epoch ends.
SOAK = [*TINY_TRAIN, "--set", "batch.micro_batches_per_update=2", "--set", "log.interval=2",
        "--save-interval-updates", str(SAVE_EVERY), "--max-update", "30"]
WALL_CLOCK = {"tokens_per_second", "mfu", "wall_seconds"}  # the only fields allowed to differ


def _jsonl(save_dir: Path) -> list[dict]:
    """train.jsonl's records, tolerating a last line cut short by a kill."""
    path = save_dir / "train.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _progress(save_dir: Path) -> int:
    """The newest update known to be done: logged, or in a complete numbered checkpoint."""
    logged = max((r["update"] for r in _jsonl(save_dir) if r["kind"] == "train"), default=0)
    return max([logged, *(update for update, _ in checkpoint.numbered_checkpoints(save_dir))])


def _without_clock(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in records]


def _assert_same_training(a: Path, b: Path) -> None:
    """Equal records (but for the clock), weights, Adam moments, best checkpoint and kept checkpoints."""
    assert _without_clock(_jsonl(a)) == _without_clock(_jsonl(b))
    last_a, last_b = model_file.load(a / LAST), model_file.load(b / LAST)
    assert last_a["train"]["update"] == last_b["train"]["update"]
    for name, tensor in last_a["model"].items():
        assert torch.equal(tensor, last_b["model"][name]), name
    moments_a, moments_b = last_a["train"]["optimizer"]["state"], last_b["train"]["optimizer"]["state"]
    for key, state in moments_a.items():
        assert torch.equal(state["exp_avg"], moments_b[key]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], moments_b[key]["exp_avg_sq"])
    assert model_file.load(a / BEST)["meta"]["update"] == model_file.load(b / BEST)["meta"]["update"]
    assert ([p.name for _, p in checkpoint.numbered_checkpoints(a)]
            == [p.name for _, p in checkpoint.numbered_checkpoints(b)])


def _kill_when(proc: subprocess.Popen, save_dir: Path, event: str, delay_seconds: float) -> bool:
    """SIGKILL `proc` at `event`; False when it finished first. "write": inside a numbered checkpoint's
    write (before its rename); "link": after a new numbered checkpoint is in place, before
    checkpoint_last.pt is; "log": as soon as this run has logged a training record (mid-training,
    perhaps inside the next append); "time": `delay_seconds` after the start, wherever it is."""
    start, known = time.monotonic(), {p.name for _, p in checkpoint.numbered_checkpoints(save_dir)}
    logged = len(_jsonl(save_dir))
    while proc.poll() is None:
        if event == "write":
            due = any(re.fullmatch(r"\.checkpoint_\d+\.pt\..*\.tmp", p.name) for p in save_dir.glob(".*.tmp"))
        elif event == "link":
            due = any(p.name not in known for _, p in checkpoint.numbered_checkpoints(save_dir))
        elif event == "log":
            due = len(_jsonl(save_dir)) > logged
        else:
            due = time.monotonic() - start >= delay_seconds
        if due:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.005)
    return False


def _window_hit(save_dir: Path, event: str) -> bool:
    """Whether the kill landed in the window its event aims at."""
    newest = checkpoint.numbered_checkpoints(save_dir)[-1:]
    if event == "write":
        return any(re.fullmatch(r"\.checkpoint_\d+\.pt\..*\.tmp", p.name) for p in save_dir.glob(".*.tmp"))
    if event == "link" and newest:
        last = model_file.load(save_dir / LAST)["train"]["update"] if (save_dir / LAST).exists() else -1
        return last < newest[0][0]
    return event in ("log", "time")


@pytest.mark.slow
def test_killed_anywhere_the_same_command_resumes_exactly(train_data: Path, tmp_path: Path) -> None:
    """Up to seven SIGKILLs in an order and at times drawn from a seeded RNG: inside checkpoint writes,
    between a numbered checkpoint and checkpoint_last.pt, right after a log append, then at random
    times (start-up, resume, training, validation, saving); after the log kill, train.jsonl also
    gets a torn last line. Each rerun of the same command resumes by itself from no more than two
    checkpoint intervals back: one, plus what was trained while a checkpoint was being written in
    the background (the next save waits for it)."""
    reference, soak = tmp_path / "reference", tmp_path / "soak"
    nmt("train", train_data, "--save-dir", reference, *SOAK)
    rng = random.Random(20240607)
    # The kills at an event come first, in a random order: each lands within a checkpoint interval
    # of where the run stood, so all five happen before the 30 updates are done however fast the
    # machine is. The timed kills follow; one may come after its run has finished, which ends the loop.
    events = ["write", "write", "link", "link", "log"]
    rng.shuffle(events)
    events += ["time", "time"]
    command = [sys.executable, "-m", "nmt_cli", "train", str(train_data), "--save-dir", str(soak), *SOAK]
    env = {**os.environ, "NMT_TEST_SAVE_PAUSE_SECONDS": "0.3", "PYTHONUNBUFFERED": "1"}
    kills, hits, torn = [], set(), False
    for run, event in enumerate([*events, "finish"]):
        done_before = _progress(soak)
        with open(tmp_path / f"run{run}.err", "w") as err:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
            killed = _kill_when(proc, soak, event, rng.uniform(3.5, 8.0)) if event != "finish" else False
            if not killed:
                assert proc.wait(timeout=300) == 0, (tmp_path / f"run{run}.err").read_text()
        text = (tmp_path / f"run{run}.err").read_text()
        if resumed := re.search(r"resuming from \S+ at update (\d+)", text):
            lost = done_before - int(resumed.group(1))
            assert 0 <= lost <= 2 * SAVE_EVERY, f"run {run} resumed {lost} updates back:\n{text}"
        if not killed:
            break
        kills.append(event)
        if _window_hit(soak, event):
            hits.add(event)
        if event in ("log", "time") and not torn and (soak / "train.jsonl").exists():
            with open(soak / "train.jsonl", "a") as f:
                f.write('{"kind": "train", "update": 9')  # an append cut short
            torn = True
    assert len(kills) >= 5 and {"write", "link", "log"} <= hits, (kills, hits)
    assert torn
    _assert_same_training(reference, soak)
    assert not list(soak.glob(".*.tmp"))


@pytest.mark.slow
def test_a_dead_worker_restarts_the_group_from_the_last_checkpoint(train_data: Path, tmp_path: Path) -> None:
    """--nproc 2 --max-restarts 1: SIGKILL to one worker (not the launcher) makes torchrun restart
    both from checkpoint_last.pt; the run finishes as an uninterrupted one does."""
    args = [*TINY_TRAIN, "--nproc", "2", "--set", "batch.micro_batches_per_update=1",
            "--save-interval-updates", "2", "--max-update", "8"]
    reference, run, pids = tmp_path / "reference", tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    nmt("train", train_data, "--save-dir", reference, *args)
    command = [sys.executable, "-m", "nmt_cli", "train", str(train_data), "--save-dir", str(run), *args,
               "--max-restarts", "1"]
    env = {**os.environ, "NMT_TEST_PID_DIR": str(pids), "NMT_TEST_SAVE_PAUSE_SECONDS": "0.3",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((pids / "rank1.restart0.pid").exists() and (run / "checkpoint_2.pt").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "training ended before the kill"
            time.sleep(0.02)
        os.kill(int((pids / "rank1.restart0.pid").read_text()), signal.SIGKILL)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert (pids / "rank0.restart1.pid").exists() and (pids / "rank1.restart1.pid").exists(), "no restart"
    assert re.search(r"resuming from \S+ at update [2-8]", output), output
    assert "Traceback" not in output, output
    _assert_same_training(reference, run)


def test_a_checkpoint_with_the_flat_train_config_of_old_resumes_under_the_new_names() -> None:
    """Checkpoints written before TrainConfig had sections hold it flat (max_tokens, valid_bleu, ...):
    resuming reads their keys under the new names, so only a real change is reported."""
    cfg = dataclasses.replace(train_base("transformer_tiny"), data=Path("bin"), save_dir=Path("run"))
    now, old_name = to_dict(cfg), {new: old for old, new in TrainConfig.RENAMED.items()}
    flat = {"model": now["model"]} | {old_name.get(k, k): v for k, v in flatten(now).items()
                                      if not k.startswith("model.")}
    assert "max_tokens" in flat and "valid_bleu" in flat and "batch" not in flat
    assert stored_settings(flat) == flatten(now)
    trainer = SimpleNamespace(cfg=cfg, micro_batches=2, ctx=SimpleNamespace(world_size=1), precision="fp32")
    state = {"config": flat, "micro_batches_per_update": 2, "world_size": 1, "precision": "fp32"}
    assert _changed_settings(trainer, state) == []
    flat |= {"lr": 1.0, "max_update": 5, "valid_bleu": True}  # when to stop and validate may change freely
    notes = _changed_settings(trainer, state)
    assert len(notes) == 1 and "(optim.lr: 1.0 vs 0.0007)" in notes[0], notes


def test_a_checkpoint_from_before_table3_settings_resumes(train_data: Path, tmp_path: Path) -> None:
    """A training checkpoint whose model config lacks d_k, d_v and positions (written before they
    existed) resumes, and averages with a new one: a missing field is its default, not a difference."""
    save = tmp_path / "run"
    nmt("train", train_data, "--save-dir", save, *TINY_TRAIN, "--max-update", "2",
        "--save-interval-updates", "1")
    for path in save.glob("checkpoint_[0-9]*.pt"):
        state = model_file.load(path)
        for key in ("d_k", "d_v", "positions"):
            del state["model_config"][key]
        model_file.save(path, state)
    (save / LAST).unlink()
    proc = nmt("train", train_data, "--save-dir", save, *TINY_TRAIN, "--max-update", "3")
    assert "resuming from" in proc.stderr and "at update 2" in proc.stderr
    nmt("average", save / "checkpoint_2.pt", save / "checkpoint_3.pt", "--out", tmp_path / "avg.pt")


def test_another_number_of_devices_goes_on_from_the_same_share_of_the_epoch() -> None:
    """More devices may pack the epoch into smaller batches (corpus.plan_train): a resume goes on from
    the same share of it, and says so; the same batches mean the same place."""
    from nmt_cli.training.counters import Counters
    from nmt_cli.training.resume import _same_place

    c = Counters()
    c.epoch_batches_done = 30
    data = SimpleNamespace(train=SimpleNamespace(batches=[None] * 200))
    assert _same_place(c, data, {"batches_per_epoch": 200}) == [] and c.epoch_batches_done == 30
    notes = _same_place(c, data, {"batches_per_epoch": 100})
    assert c.epoch_batches_done == 60 and len(notes) == 1 and "200 batches instead of 100" in notes[0]
    c.epoch_batches_done = 99
    _same_place(c, SimpleNamespace(train=SimpleNamespace(batches=[None] * 10)), {"batches_per_epoch": 100})
    assert c.epoch_batches_done == 10, "never past the epoch's end"
    c.epoch_batches_done = 7
    assert _same_place(c, data, {}) == [] and c.epoch_batches_done == 7, "a checkpoint from before: as it was"
