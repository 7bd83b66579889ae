"""Non-finite values and out-of-memory micro-batches: caught where they happen, decided alike on every
rank, skipped and counted, and a clear stop when they keep coming. Faults are injected through the
test-only NMT_TEST_FAULTS hook (guard.py) into real `nmt train` runs, on two gloo workers where the
point is that ranks agree."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import fault_hooks
from conftest import TINY_TRAIN, assert_user_error, nmt, tiny_trainer, train_records
from nmt_cli.config.model import ModelConfig
from nmt_cli.config.train import BatchConfig, GuardConfig, TrainConfig, train_base
from nmt_cli.data.dataset import IndexedDataset
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import guard, train
from nmt_cli.training.counters import Counters

TWO_RANKS = [*TINY_TRAIN, "--nproc", "2", "--set", "batch.micro_batches_per_update=1"]


def _last_parameter() -> str:
    """The parameter whose gradient the `grad` fault poisons: the model's last, in module order."""
    return [name for name, _ in Transformer(ModelConfig(d_model=32, d_ff=64, heads=2, encoder_layers=2,
                                                        decoder_layers=2), 10).named_parameters()][-1]


def _updates_by_epoch(path: Path) -> dict[int, list[int]]:
    """NMT_TEST_EXAMPLE_LOG lines "EPOCH UPDATE IDS...": the update counter of each trained micro-batch."""
    found: dict[int, list[int]] = defaultdict(list)
    for line in path.read_text().splitlines():
        epoch, update = map(int, line.split()[:2])
        found[epoch].append(update)
    return found


def _assert_ranks_counted_alike(log_dir: Path) -> None:
    """With one micro-batch per update: both ranks' update counters moved together (rank 1 may lack an
    epoch's last update, which has a batch for rank 0 only), so no rank stepped where another skipped."""
    rank0, rank1 = (_updates_by_epoch(log_dir / f"examples.rank{r}.txt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for epoch, updates in rank1.items():
        assert updates == rank0[epoch][: len(updates)] and len(rank0[epoch]) - len(updates) in (0, 1), epoch


# ---------------------------------------------------------------------------------------------
# The pure parts


def test_fault_specs_select_attempts_micro_batches_and_ranks() -> None:
    import os

    os.environ["NMT_TEST_FAULTS"] = "loss@3/1 grad@4-6 oom@2.1/0 oom-backward@5.2"
    try:
        rank0, rank1 = fault_hooks.Faults.from_env(0), fault_hooks.Faults.from_env(1)
        assert not rank0.wanted("loss", 3) and rank1.wanted("loss", 3)
        assert all(rank1.wanted("grad", a) for a in (4, 5, 6)) and not rank1.wanted("grad", 7)
        assert rank0.wanted("oom", 2, 1) and not rank0.wanted("oom", 2, 2) and not rank1.wanted("oom", 2, 1)
        assert rank1.wanted("oom-backward", 5, 2)
        os.environ["NMT_TEST_FAULTS"] = "nan@3"
        with pytest.raises(AssertionError, match="nan@3"):
            fault_hooks.Faults.from_env(0)
    finally:
        del os.environ["NMT_TEST_FAULTS"]
    assert fault_hooks.Faults.from_env(0).entries == []


def _scaler_after_backward(grad_value: float) -> torch.amp.GradScaler:
    """A CPU GradScaler (scale 1024) that has unscaled a gradient holding `grad_value`."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((param * torch.tensor([1.0, grad_value, 1.0])).sum()).backward()
    scaler.unscale_(optimizer)
    return scaler


def test_a_skip_shrinks_the_loss_scale_alike_whichever_rank_saw_it() -> None:
    saw_it, did_not = _scaler_after_backward(float("inf")), _scaler_after_backward(1.0)
    guard.update_loss_scale(saw_it, finite=False, finite_here=False)
    guard.update_loss_scale(did_not, finite=False, finite_here=True)
    assert saw_it.get_scale() == did_not.get_scale() == 512.0
    fine = _scaler_after_backward(1.0)
    guard.update_loss_scale(fine, finite=True, finite_here=True)
    assert fine.get_scale() == 1024.0


def test_the_first_nonfinite_value_in_module_order_is_named() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert guard.first_nonfinite(model) is None
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    model[1].bias.grad = torch.tensor([0.0, float("inf")])
    assert guard.first_nonfinite(model) == "1.bias (its gradient)"
    model[1].bias.grad = None
    assert guard.first_nonfinite(model) == "2.weight (its value)"


def test_out_of_memory_share_and_the_stop_message() -> None:
    cfg = TrainConfig(data=Path("bin"), save_dir=Path("run"), batch=BatchConfig(max_tokens=4096),
                      guard=GuardConfig(max_oom_fraction=0.02))
    # one alone never stops
    guard.check_out_of_memory(cfg, Counters(oom_micro_batches=1, micro_batches=2), 10)
    guard.check_out_of_memory(cfg, Counters(oom_micro_batches=2, micro_batches=200), 10)
    with pytest.raises(NmtError, match=r"3 of 100 micro-batches .* --max-tokens \(now 4096.*"
                                       r"checkpoint_last.pt \(update 10\)"):
        guard.check_out_of_memory(cfg, Counters(update=12, oom_micro_batches=3, micro_batches=100), 10)


# ---------------------------------------------------------------------------------------------
# Non-finite values in real runs


@pytest.mark.slow
def test_a_nan_on_one_rank_is_skipped_on_both(train_data: Path, tmp_path: Path) -> None:
    """Rank 1 alone sees a NaN loss at the 2nd update attempt and an infinite gradient (after the
    all-reduce) at the 4th. Both ranks skip both, count them, and train on; their weights are
    still bitwise equal at the checkpoint (the save compares them)."""
    logs = tmp_path / "examples"
    logs.mkdir()
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", *TWO_RANKS, "--max-update", "6",
               "--save-interval-updates", "6",
               env={"NMT_TEST_FAULTS": "loss@2/1 grad@4/1", "NMT_TEST_EXAMPLE_LOG": str(logs)})
    assert "update 2: skipped, non-finite loss on 1 and non-finite gradients on 0 of 2 rank(s)" in proc.stderr
    assert "update 3: skipped, non-finite loss on 0 and non-finite gradients on 1 of 2 rank(s)" in proc.stderr
    records = train_records(tmp_path / "run")
    assert [r["update"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert (sum(r["skipped_updates"] for r in records) == 2
            and [r["skipped_updates"] for r in records][1:3] == [1, 1])
    # nothing non-finite reached the log
    assert all(r["loss"] == r["loss"] and r["gnorm"] < 1e3 for r in records)
    assert model_file.load(tmp_path / "run" / "checkpoint_last.pt")["train"]["skipped_updates"] == 2
    _assert_ranks_counted_alike(logs)


@pytest.mark.slow
def test_nonfinite_updates_in_a_row_stop_with_the_place_and_the_checkpoint(train_data: Path,
                                                                           tmp_path: Path) -> None:
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", *TWO_RANKS, "--max-update", "20",
               "--save-interval-updates", "2", "--set", "guard.max_bad_updates=2",
               env={"NMT_TEST_FAULTS": "grad@5-100/1"}, check=False)
    assert_user_error(proc, "update 5: 3 updates in a row were skipped for non-finite values",
                      "non-finite gradients on 1 of 2 rank(s)",
                      f"{_last_parameter()} (its gradient) on rank 1",
                      "checkpoint_last.pt (update 4)", "learning rate")
    assert [r["update"] for r in train_records(tmp_path / "run")] == [1, 2, 3, 4]

    alone = nmt("train", train_data, "--save-dir", tmp_path / "alone", *TINY_TRAIN, "--max-update", "20",
                "--set", "guard.max_bad_updates=1", env={"NMT_TEST_FAULTS": "loss@3-100"}, check=False)
    assert_user_error(alone, "update 3: 2 updates in a row", "the loss itself was",
                      "no checkpoint was saved yet")


@pytest.mark.slow
def test_fp16_overflow_shrinks_the_scale_on_every_rank_and_a_floor_stops(train_data: Path,
                                                                         tmp_path: Path) -> None:
    """Rank 1 alone overflows at update attempts 3 and 4: both ranks halve the scale twice (the
    checkpoint at update 5 is only written after the ranks compared their scales). Overflowing on and
    on from attempt 8, the scale falls below the floor and the run stops."""
    save = tmp_path / "run"
    proc = nmt("train", train_data, "--save-dir", save, *TWO_RANKS, "--precision", "fp16",
               "--save-interval-updates", "5", "--max-update", "20", "--set", "guard.min_loss_scale=5000",
               env={"NMT_TEST_FAULTS": "grad@3-4/1 grad@8-100/1"}, check=False)
    assert_user_error(proc, "update 6: the fp16 loss scale fell to 4096, below guard.min_loss_scale=5000",
                      "--precision bf16", "checkpoint_last.pt (update 5)")
    scales = [int(scale) for scale in re.findall(r"fp16 loss scale now (\d+)", proc.stderr)]
    assert scales == [32768, 16384, 8192, 4096], proc.stderr
    assert model_file.load(save / "checkpoint_last.pt")["train"]["scaler"]["scale"] == 16384.0


# ---------------------------------------------------------------------------------------------
# Out of memory in real runs


@pytest.mark.slow
def test_out_of_memory_micro_batches_are_skipped_and_the_rest_trained(train_data: Path,
                                                                      tmp_path: Path) -> None:
    """Two ranks, two micro-batches each per update. Rank 1 runs out of memory in the forward of its
    gradient-synchronising micro-batch (update 2), rank 0 in a local one (update 4), rank 1 in a local
    backward (update 5). Nobody waits forever, each is counted once, and every update's logged target
    tokens are exactly those of the examples that were trained."""
    logs = tmp_path / "examples"
    logs.mkdir()
    faults = "oom@2.2/1 oom@4.1/0 oom-backward@5.1/1"
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", *TINY_TRAIN, "--nproc", "2",
               "--set", "batch.micro_batches_per_update=2", "--max-update", "6",
               "--save-interval-updates", "6", "--set", "guard.max_oom_fraction=0.5",
               env={"NMT_TEST_FAULTS": faults, "NMT_TEST_EXAMPLE_LOG": str(logs)})
    for update in (2, 4, 5):
        assert (f"update {update}: 1 micro-batch(es) ran out of memory and were skipped"
                in proc.stderr), proc.stderr
    records = train_records(tmp_path / "run")
    assert [r["update"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["oom_micro_batches"] for r in records] == [0, 1, 0, 1, 1, 0]
    sizes = IndexedDataset(train_data / "train.yy").sizes
    trained: dict[int, int] = defaultdict(int)
    for rank in (0, 1):
        for line in (logs / f"examples.rank{rank}.txt").read_text().splitlines():
            _, update, *ids = map(int, line.split())
            trained[update + 1] += int(sizes[ids].sum()) + len(ids)  # + EOS; logged before the step counts
    assert {r["update"]: r["tgt_tokens"] for r in records} == dict(trained)
    assert (tmp_path / "run" / "checkpoint_6.pt").exists()  # saved after the ranks compared their weights


@pytest.mark.parametrize(("fault", "kept"), [("oom@1.2", [0, 2]), ("oom-backward@1.2", [2])])
def test_a_dropped_micro_batch_leaves_nothing_in_the_update(train_data: Path, tmp_path: Path, fault: str,
                                                            kept: list[int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One update of micro-batches 0, 1, 2 where 1 runs out of memory in its forward (only it is
    dropped) or in its backward (0 goes too: the gradients held part of 1). The gradient the optimiser
    steps with equals that of the micro-batches kept, trained alone: nothing of the dropped ones
    leaks in, and it is the mean over the tokens trained. With all three it differs (the control)."""
    def gradient(batches: list[int], faults: str) -> dict[str, torch.Tensor]:
        monkeypatch.setenv("NMT_TEST_FAULTS", faults)
        trainer, stepped = tiny_trainer(train_data, tmp_path), {}
        step = trainer.step.scaler.step

        def keep_and_step(optimizer: torch.optim.Optimizer) -> None:
            stepped.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
            step(optimizer)

        monkeypatch.setattr(trainer.step.scaler, "step", keep_and_step)
        split = trainer.data.train
        trainer.update([split.batches[i] for i in batches], int(split.tgt_tokens[batches].sum()),
                       len(batches))
        return stepped

    dropped, alone, full = gradient([0, 1, 2], fault), gradient(kept, ""), gradient([0, 1, 2], "")
    for name, grad in alone.items():  # equal to float32 rounding of sums taken in another order
        torch.testing.assert_close(dropped[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))
    assert any(not torch.allclose(full[name], grad, rtol=1e-3) for name, grad in alone.items())


@pytest.mark.slow
def test_too_many_out_of_memory_micro_batches_stop_naming_max_tokens(train_data: Path,
                                                                     tmp_path: Path) -> None:
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", *TINY_TRAIN,
               "--set", "batch.micro_batches_per_update=2", "--max-update", "10",
               env={"NMT_TEST_FAULTS": "oom@1-100"}, check=False)
    assert_user_error(proc, "update 1: 2 of 2 micro-batches so far ran out of memory",
                      "guard.max_oom_fraction=0.02", "Lower --max-tokens (now 256")


@pytest.mark.slow
def test_out_of_memory_in_the_synchronising_backward_stops_cleanly(train_data: Path,
                                                                   tmp_path: Path) -> None:
    """The one case that cannot be skipped (DDP's all-reduce has begun): a clear stop, not a hang."""
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", *TWO_RANKS, "--max-update", "10",
               env={"NMT_TEST_FAULTS": "oom-backward@2.1/1"}, check=False, timeout=120)
    assert_user_error(proc, "out of memory in the gradient-synchronising backward pass on rank 1",
                      "--max-tokens")


@pytest.mark.slow
def test_dry_run_tries_the_largest_batch(train_data: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["train", train_data, "--save-dir", tmp_path / "run", *TINY_TRAIN, "--dry-run",
            "--try-largest-batch"]
    assert "largest batch: fits on cpu" in nmt(*args).stdout
    cfg = dataclasses.replace(train_base("transformer_tiny"), data=train_data, save_dir=tmp_path / "run",
                              precision="fp32", batch=BatchConfig(max_tokens=256), dry_run=True,
                              try_largest_batch=True,
                              model=ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64,
                                                heads=2))
    monkeypatch.setenv("NMT_TEST_FAULTS", "oom@0")
    with pytest.raises(NmtError, match="does not fit in the memory of cpu .* lower --max-tokens"):
        train.run(cfg)
    assert not (tmp_path / "run").exists()
    with pytest.raises(NmtError, match="add --dry-run"):
        train.run(dataclasses.replace(cfg, dry_run=False))
