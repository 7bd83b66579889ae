"""`nmt train` end to end on the CPU: outputs, exact resume, crashes during saves, torchrun with gloo.

Every run drives the real command line on a synthetic binarized folder (tests/synthetic_binarized.py)
with a model small enough to train a few updates in seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN, assert_user_error, nmt
from conftest import train_records as _records
from nmt_cli.config.core import read_yaml
from nmt_cli.config.model import ModelConfig
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import checkpoint

pytestmark = pytest.mark.slow  # each test trains a small model through the real command line

SMALL = TINY_TRAIN


@pytest.fixture
def data_dir(train_data: Path) -> Path:
    return train_data  # 150 training pairs plus 2 too long (ids 150, 151)


def test_dry_run_prints_the_plan_without_training(data_dir: Path, tmp_path: Path) -> None:
    out = nmt("train", data_dir, "--save-dir", tmp_path / "run", *SMALL, "--dry-run").stdout
    for needle in ("parameters:", "devices: 1", "max_tokens per device: 256", "accumulation:",
                   "tokens per update:", "peak learning rate:", "checkpoints:",
                   "plan: stop at the first of 100,000 updates"):
        assert needle in out, out
    assert not (tmp_path / "run").exists()
    big = nmt("train", data_dir, "--save-dir", tmp_path / "run", "--arch", "transformer_big", "--gpus", "8",
              "--dry-run").stdout
    assert "devices: 8 (1 node(s) x 8 GPU(s))" in big and "parameters: " in big
    assert "peak learning rate: 4.941e-04" in big  # 1024^-0.5 * 4000^-0.5


def test_training_writes_checkpoints_log_and_config(data_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "run"
    proc = nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "6",
               "--save-interval-updates", "2", "--keep-last", "2")
    assert "skipped 2 of 152 training examples longer than 256 tokens" in proc.stderr
    names = sorted(p.name for p in save.glob("checkpoint*.pt"))
    assert names == ["checkpoint_4.pt", "checkpoint_6.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    state = model_file.load(save / "checkpoint_last.pt")  # torch.load(weights_only=True) + checksum
    assert state["kind"] == "checkpoint" and state["train"]["update"] == 6
    for key in ("model", "model_config", "dictionary", "spm_model", "meta", "train"):
        assert key in state
    for key in ("optimizer", "scaler", "rng", "epoch", "epoch_batches_done", "config", "best_valid_loss"):
        assert key in state["train"]
    assert (state["model_config"]["d_model"] == 32
            and state["spm_model"] == (data_dir / "spm.model").read_bytes())
    train, valid = _records(save), _records(save, "valid")
    assert [r["update"] for r in train] == [1, 2, 3, 4, 5, 6]
    for field in ("update", "epoch", "loss", "nll", "ppl", "lr", "gnorm", "src_tokens", "tgt_tokens",
                  "tokens_per_second", "mfu", "wall_seconds"):
        assert field in train[0]
    # model FLOPs utilisation against the CPU's measured matrix-product peak, in the log too
    assert all(0 < r["mfu"] < 1 for r in train) and "mfu=" in proc.stderr
    assert "peak_tflops_per_device=" in proc.stderr and "CPU, measured matrix product" in proc.stderr
    assert [r["update"] for r in valid] == [2, 4, 6] and all("ppl" in r for r in valid)
    config = read_yaml(save / "config.yaml")
    assert config["stop"]["max_update"] == 6 and config["model"]["d_model"] == 32


def test_resume_continues_exactly(data_dir: Path, tmp_path: Path) -> None:
    """8 updates straight vs 4, stop, the same command to 8: identical losses and weights (fp32,
    dropout on)."""
    args = [*SMALL, "--save-interval-updates", "3"]  # a checkpoint mid-run too, and an epoch ends inside
    nmt("train", data_dir, "--save-dir", tmp_path / "straight", *args, "--max-update", "8")
    nmt("train", data_dir, "--save-dir", tmp_path / "resumed", *args, "--max-update", "4")
    second = nmt("train", data_dir, "--save-dir", tmp_path / "resumed", *args, "--max-update", "8")
    assert "resuming from" in second.stderr and "at update 4" in second.stderr
    straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [r["update"] for r in resumed] == list(range(1, 9))
    assert len({r["epoch"] for r in straight}) > 1, "the run should cross an epoch boundary"
    for a, b in zip(straight, resumed, strict=True):
        assert (a["loss"], a["nll"], a["gnorm"], a["lr"], a["tgt_tokens"]) == (
            b["loss"], b["nll"], b["gnorm"], b["lr"], b["tgt_tokens"])
    a, b = (model_file.load(d / "checkpoint_last.pt") for d in (tmp_path / "straight", tmp_path / "resumed"))
    assert a["model_config"]["dropout"] > 0
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name

    other = nmt("train", data_dir, "--save-dir", tmp_path / "resumed", *args, "--set", "model.d_ff=128",
                "--max-update", "10", check=False)
    assert_user_error(other, "d_ff: 64 vs 128", "another model")


def test_a_resume_from_a_newer_numbered_checkpoint_brings_checkpoint_last_up_to_date(data_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """A crash between checkpoint_6.pt and its link checkpoint_last.pt (here: last names update 3)
    and a rerun that has nothing left to train: checkpoint_last.pt still ends at update 6."""
    save = tmp_path / "run"
    args = [*SMALL, "--save-interval-updates", "3", "--max-update", "6"]
    nmt("train", data_dir, "--save-dir", save, *args)
    (save / "checkpoint_last.pt").unlink()  # a name of checkpoint_6.pt's file: not written into
    os.link(save / "checkpoint_3.pt", save / "checkpoint_last.pt")
    again = nmt("train", data_dir, "--save-dir", save, *args)
    assert "checkpoint_6.pt at update 6" in again.stderr
    assert model_file.load(save / "checkpoint_last.pt")["train"]["update"] == 6


def test_a_training_state_of_another_layout_is_refused_by_name(data_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose checksum is valid but whose training state lacks a part (another nmt version)
    stops `nmt train` with a message naming the file, not a traceback."""
    save = tmp_path / "run"
    nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "2")
    for path in save.glob("checkpoint*.pt"):
        state = model_file.load(path)
        del state["train"]["optimizer"]
        path.unlink()
        model_file.save(path, state)
    proc = nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "4", check=False)
    assert_user_error(proc, "checkpoint_last.pt has a training state this nmt cannot resume from",
                      "optimizer")


def test_kill_during_a_checkpoint_write_leaves_the_previous_one(data_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "nmt_cli", "train", str(data_dir), "--save-dir", str(save), *SMALL,
           "--save-interval-updates", "2", "--max-update", "8"]
    env = {**os.environ, "NMT_TEST_SAVE_PAUSE_SECONDS": "3"}  # each save sleeps before its rename
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(save.glob(".checkpoint_4.pt.*.tmp")):  # inside the second save, before its rename
            assert proc.poll() is None and time.monotonic() < deadline, \
                "training ended before its second save"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (save / "checkpoint_4.pt").exists()
    assert model_file.load(save / "checkpoint_last.pt")["train"]["update"] == 2
    again = nmt("train", data_dir, "--save-dir", save, *SMALL, "--save-interval-updates", "2",
                "--max-update", "6")
    assert "at update 2" in again.stderr and "interrupted" in again.stderr
    assert [r["update"] for r in _records(save)] == [1, 2, 3, 4, 5, 6]
    assert not list(save.glob(".*.tmp"))


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(b ^ 0xFF
                                                      for b in data[len(data) // 2 : len(data) // 2 + 8])
    path.write_bytes(bytes(data))


def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(data_dir: Path, tmp_path: Path) -> None:
    """checkpoint_last.pt is a hard link to the newest numbered checkpoint: damage to it (flipped bytes,
    a truncation) shows under both names and costs one checkpoint interval, the numbered checkpoint
    before takes over; a folder of damaged files is refused, never restarted from scratch. Every
    skipped file is named."""
    save = tmp_path / "run"
    args = [*SMALL, "--save-interval-updates", "2"]
    nmt("train", data_dir, "--save-dir", save, *args, "--max-update", "4")
    _flip_bytes(save / "checkpoint_last.pt")
    again = nmt("train", data_dir, "--save-dir", save, *args, "--max-update", "6")
    warnings = [line for line in again.stderr.splitlines() if line.startswith("warning:")]
    assert any("checkpoint_last.pt is corrupt" in w for w in warnings), again.stderr
    assert any("checkpoint_4.pt is corrupt" in w for w in warnings), again.stderr
    assert "resuming from" in again.stderr and "checkpoint_2.pt at update 2" in again.stderr

    with open(save / "checkpoint_last.pt", "r+b") as f:  # now the file of update 6
        f.truncate(f.seek(0, 2) // 2)
    third = nmt("train", data_dir, "--save-dir", save, *args, "--max-update", "8")
    warnings = [line for line in third.stderr.splitlines() if line.startswith("warning:")]
    for name in ("checkpoint_last.pt", "checkpoint_6.pt"):
        assert any(f"{name} is" in w and "truncated" in w for w in warnings), third.stderr
    assert "checkpoint_4.pt at update 4" in third.stderr
    # updates 3, 4 and then 5, 6 trained again, logged once
    assert [r["update"] for r in _records(save)] == list(range(1, 9))

    for path in save.glob("checkpoint*.pt"):
        path.write_bytes(b"garbage")
    refused = nmt("train", data_dir, "--save-dir", save, *args, "--max-update", "10", check=False)
    assert_user_error(refused, "none can be resumed", "checkpoint_last.pt", "checkpoint_8.pt",
                      "checkpoint_best.pt")


def test_two_gloo_workers_equal_one_worker_with_twice_the_accumulation(data_dir: Path,
                                                                       tmp_path: Path) -> None:
    """Same updates from the same examples: 2 ranks x 1 micro-batch vs 1 rank x 2 micro-batches.
    Gradients meet through gloo's all-reduce instead of local accumulation, so the weights are held
    to 1e-5 (absolute and relative); with two ranks they have come out bit-identical."""
    args = [*SMALL, "--set", "model.dropout=0", "--max-update", "0", "--max-epoch", "1",
            "--set", "optim.lr_schedule=inverse_sqrt", "--set", "optim.lr=1e-3",
            "--set", "optim.warmup_updates=0"]
    logs = {name: tmp_path / f"ids-{name}" for name in ("two", "one")}
    for folder in logs.values():
        folder.mkdir()
    nmt("train", data_dir, "--save-dir", tmp_path / "two", *args, "--nproc", "2",
        "--set", "batch.micro_batches_per_update=1", env={"NMT_TEST_EXAMPLE_LOG": str(logs["two"])})
    nmt("train", data_dir, "--save-dir", tmp_path / "one", *args, "--set", "batch.micro_batches_per_update=2",
        env={"NMT_TEST_EXAMPLE_LOG": str(logs["one"])})
    two, one = (model_file.load(tmp_path / d / "checkpoint_last.pt") for d in ("two", "one"))
    assert two["train"]["world_size"] == 2 and len(two["train"]["rng"]) == 2
    assert two["train"]["update"] == one["train"]["update"] > 2
    for name, tensor in one["model"].items():
        torch.testing.assert_close(two["model"][name], tensor, atol=1e-5, rtol=1e-5)
    torch.manual_seed(1)  # the default seed: the trainer's initial weights
    initial = Transformer(ModelConfig(**one["model_config"]), len(one["dictionary"]["symbols"])).state_dict()
    moved = max((initial[n] - t).abs().max().item() for n, t in one["model"].items())
    assert moved > 1e-3, "training should move the weights far beyond the tolerance"

    ranks = [_example_ids(logs["two"] / f"examples.rank{r}.txt") for r in (0, 1)]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]
    assert (ranks[0] | ranks[1] == _example_ids(logs["one"] / "examples.rank0.txt")
            == set(range(150)))  # 2 too long

    mismatch = nmt("train", data_dir, "--save-dir", tmp_path / "two", *args, "--nproc", "2",
                   "--set", "model.d_ff=128", "--max-epoch", "2", check=False)
    assert_user_error(mismatch, "d_ff: 64 vs 128")


def _example_ids(path: Path) -> set[int]:
    ids: list[int] = []
    for line in path.read_text().splitlines():
        ids += map(int, line.split()[2:])
    assert len(ids) == len(set(ids)), f"{path}: an example was trained on twice in one epoch"
    return set(ids)


def test_validation_bleu_is_what_the_saved_model_translates(data_dir: Path, tmp_path: Path) -> None:
    """Two gloo workers each translate a share of the valid split; the logged BLEU equals greedy search
    with the checkpoint saved at that update, scored by sacreBLEU here; checkpoint_best has the best BLEU."""
    import sacrebleu
    import sentencepiece as spm

    from nmt_cli.config.inference import TranslateConfig
    from nmt_cli.data.dataset import EOS, IndexedDataset
    from nmt_cli.inference.search import translate_ids

    save = tmp_path / "run"
    nmt("train", data_dir, "--save-dir", save, *SMALL, "--nproc", "2", "--max-update", "6",
        "--save-interval-updates", "3", "--valid-bleu", "--set", "valid.bleu_sentences=20",
        "--set", "checkpoint.best_metric=bleu", "--set", "valid.interval_updates=0")
    valid = {r["update"]: r for r in _records(save, "valid")}
    assert set(valid) == {3, 6} and all("bleu" in r for r in valid.values())
    model, dictionary, sp_bytes = model_file.load_model(save / "checkpoint_6.pt")
    sp = spm.SentencePieceProcessor(model_proto=sp_bytes)
    src, tgt = IndexedDataset(data_dir / "valid.xx"), IndexedDataset(data_dir / "valid.yy")
    found = translate_ids(model, [[*src[i].tolist(), EOS] for i in range(20)],
                          TranslateConfig(model=None, beam=1))
    hyps = [sp.decode(dictionary.decode(h[0].tokens)) for h in found]
    refs = [sp.decode(dictionary.decode(tgt[i].tolist())) for i in range(20)]
    assert valid[6]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score,
                                             abs=5.1e-5)  # logged to 4 places
    best_update = model_file.load(save / "checkpoint_best.pt")["meta"]["update"]
    assert valid[best_update]["bleu"] == max(r["bleu"] for r in valid.values())


def test_best_by_bleu_needs_validation_bleu(data_dir: Path, tmp_path: Path) -> None:
    proc = nmt("train", data_dir, "--save-dir", tmp_path / "run", *SMALL,
               "--set", "checkpoint.best_metric=bleu", check=False)
    assert_user_error(proc, "--valid-bleu")


def test_time_limits_save_by_the_clock_and_stop(data_dir: Path, tmp_path: Path) -> None:
    """No update or epoch limit: the clock saves every 0.6 s and stops the run after 3.6 s."""
    save = tmp_path / "run"
    nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "0", "--max-epoch", "0",
        "--max-time-hours", "0.001", "--save-interval-minutes", "0.01", "--keep-last", "100")
    state = model_file.load(save / "checkpoint_last.pt")
    assert state["train"]["train_seconds"] >= 3.6
    assert len(checkpoint.numbered_checkpoints(save)) >= 2, "the clock should have saved before the end"
    again = nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "0", "--max-epoch", "0",
                "--max-time-hours", "0.001", "--save-interval-minutes", "0.01", "--keep-last", "100")
    assert "nothing to do" in again.stderr  # the time limit counts training time across restarts


def test_averaged_checkpoints_follow_updates_and_the_clock_saves_for_crashes_only(data_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """The recipes' cadence, run fast: a numbered checkpoint every 4 updates and the clock due after
    0.6 ms. The clock's saves write checkpoint_last.pt only, so `nmt average --last` takes the
    cadence's checkpoints alone; a run stopped by its time limit resumes from the clock's save."""
    save = tmp_path / "run"
    cadence = ["--save-interval-updates", "4", "--save-interval-minutes", "0.00001", "--keep-last", "100"]
    nmt("train", data_dir, "--save-dir", save, *SMALL, *cadence, "--max-update", "0", "--max-time-hours",
        "0.0003")
    stopped = model_file.load(save / "checkpoint_last.pt")["train"]["update"]
    valid = [r["update"] for r in _records(save, "valid")]
    # The clock is read before each update: it is due at update 2 (off the cadence), or already at
    # update 1 where the start took more than its 0.6 ms (CI's loaded 2-core machine did once).
    assert stopped >= 2 and valid[0] in (1, 2) and valid[-1] == stopped
    assert all(u in valid or u - 1 in valid for u in range(3, stopped + 1)), valid
    assert all(u % 4 == 0 for u, _ in checkpoint.numbered_checkpoints(save))
    end = max(stopped + 3, 9)  # at least three numbered checkpoints: 4, 8 and the end
    again = nmt("train", data_dir, "--save-dir", save, *SMALL, *cadence, "--max-update", end)
    assert f"resuming from {save / 'checkpoint_last.pt'} at update {stopped}" in again.stderr
    numbered = [u for u, _ in checkpoint.numbered_checkpoints(save)]
    assert numbered == [*range(4, end, 4), end], "the cadence and the end of training, nothing else"
    nmt("average", save, "--last", "3", "--out", tmp_path / "avg.pt")
    assert model_file.load(tmp_path / "avg.pt")["meta"]["updates"] == numbered[-3:]
    too_many = nmt("average", save, "--last", len(numbered) + 1, "--out", tmp_path / "all.pt", check=False)
    assert_user_error(too_many, f"holds {len(numbered)} numbered checkpoints")


def test_validation_on_the_first_batches_only(data_dir: Path, tmp_path: Path) -> None:
    """valid.max_batches=2: the validation loss covers exactly the valid split's first two batches."""
    from nmt_cli.config.core import resolve
    from nmt_cli.config.train import TrainConfig, train_base
    from nmt_cli.training import corpus

    save = tmp_path / "run"
    nmt("train", data_dir, "--save-dir", save, *SMALL, "--max-update", "1", "--set", "valid.max_batches=2")
    cfg = resolve(TrainConfig, save / "config.yaml", {}, base=train_base("transformer_tiny"))
    valid = corpus.load(cfg).valid
    assert len(valid.batches) > 2
    assert [r["tgt_tokens"] for r in _records(save, "valid")] == [int(valid.tgt_tokens[:2].sum())]
