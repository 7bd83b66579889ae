"""The training step does not wait for the device between log lines (issue: a fast train step)."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_user_error, nmt, tiny_trainer, why_torch_compile_cannot_run
from nmt_cli.config.model import ModelConfig
from nmt_cli.config.train import LogConfig, OptimConfig
from nmt_cli.training import train
from nmt_cli.training.step import COMPILED_MULTIPLE, Totals, compiled_graphs


class HostSyncs(TorchDispatchMode):
    """Records every operation that makes the host wait for the device on a GPU: reading a value
    (`item`, `bool`, `float`, `tolist`, `numpy`), selecting by a mask or counting non-zeros (the size of
    the result lives on the device), and turning a host value into a device tensor (`torch.tensor`, a
    number assigned into a tensor: a blocking copy). On the CPU these cost nothing, so they are counted
    by name rather than timed."""

    SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.lift_fresh.default", "aten.unique_consecutive.default", "aten._unique2.default"}

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in self.SYNCING or (name.startswith("aten.index.Tensor") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)):
            where = _caller()
            if " _host: " not in where:  # Batches._host: the next batch, in host memory on purpose
                self.found.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncs:
        # tolist and numpy read the data without passing through the dispatcher
        self.saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, self._recording(name, method))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)

    def _recording(self, name: str, method: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.found.append(f"Tensor.{name} at {_caller()}")
            return method(tensor, *args, **kwargs)
        return read


def _caller() -> str:
    """The innermost line of nmt's own code on the stack (in `Batches._host`: the collating thread)."""
    for frame in reversed(traceback.extract_stack()):
        if "nmt_cli" in frame.filename and not frame.name.startswith("<"):  # not a comprehension
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}: {frame.line}"
    return "outside nmt_cli"


def test_the_counter_sees_what_makes_the_host_wait() -> None:
    x = torch.randn(4, 3)
    for read in (lambda: x.sum().item(), lambda: bool((x > 0).all()), lambda: x[x > 0], lambda: x.tolist(),
                 lambda: torch.tensor([1.0]), lambda: float(x.norm())):
        with HostSyncs() as syncs:
            read()
        assert syncs.found, read
    with HostSyncs() as syncs:
        x.mul(2).sum().add_(3)
    assert syncs.found == []


@pytest.fixture
def trainer(train_data: Path, tmp_path: Path) -> train.Trainer:
    return tiny_trainer(train_data, tmp_path, log=LogConfig(interval=4))


@pytest.mark.parametrize(("precision", "micro"), [("fp32", 1), ("bf16", 3)])
def test_an_update_between_log_lines_never_waits_for_the_device(train_data: Path, tmp_path: Path,
                                                                precision: str, micro: int) -> None:
    """Updates 2 and 3 of a run logging every 4 (forward with dropout, loss, backward, norm,
    clipping, the optimiser step that the device skips on a non-finite value, the log statistics)
    make no host sync; update 4 reads them all at once, and its log line counts all four."""
    trainer = tiny_trainer(train_data, tmp_path, log=LogConfig(interval=4), precision=precision,
                           model=ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64, heads=2,
                                             dropout=0.1, attention_dropout=0.1),
                           optim=OptimConfig(lr_schedule="inverse_sqrt", lr=1e-3, warmup_updates=0,
                                             clip_norm=1.0))
    split = trainer.data.train

    def update(u: int) -> bool | None:
        ids = [i % len(split.batches) for i in range(u * micro, (u + 2) * micro)]
        mine, upcoming = ids[:micro], split.batches[ids[micro]]
        return trainer.update([split.batches[i] for i in mine], int(split.tgt_tokens[mine].sum()), micro,
                              upcoming)

    assert update(0) is None  # the first update allocates Adam's moments
    with HostSyncs() as quiet:
        assert update(1) is None and update(2) is None
    assert quiet.found == []
    assert trainer.counters.update == 3 and trainer.interval.updates == 0  # counted, not yet read
    with HostSyncs() as settled:
        assert update(3) is True
    assert settled.found  # the control: the counter sees the one read of the sync point
    assert trainer.counters.update == 4 and trainer.counters.skipped_updates == 0
    assert trainer.interval.updates == 0  # reset by the log line of update 4, which saw all four


def test_a_skipped_update_is_settled_at_the_next_sync_and_moves_no_weight(
        trainer: train.Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-finite loss at update 2 (of a log every 4): the device skips the optimiser step (the
    weights and Adam's state stay as they were), the host learns it at update 4, where the update
    count falls back to 3 and the skip is counted; the log line then comes at the 4th applied update."""
    monkeypatch.setenv("NMT_TEST_FAULTS", "loss@2")
    split = trainer.data.train

    def update(u: int) -> bool | None:
        return trainer.update([split.batches[u]], int(split.tgt_tokens[[u]].sum()), 1)

    update(0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps = [float(s["step"]) for s in trainer.step.optimizer.state.values()]
    assert update(1) is None
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [float(s["step"]) for s in trainer.step.optimizer.state.values()] == steps
    assert update(2) is None and update(3) is True
    c = trainer.counters
    assert (c.update, c.skipped_updates, c.bad_updates) == (3, 1, 0)
    assert trainer.interval.updates == 3  # no log line yet: update 4 is the next applied one
    assert update(4) is True and trainer.interval.updates == 0


@pytest.mark.slow
def test_compiled_training_follows_eager(train_data: Path, tmp_path: Path) -> None:
    """`nmt train --compile`: 20 updates in bf16 give the losses the eager step gives, within bf16's
    rounding; the batches are padded to a multiple of 8 positions and a graph or two serve them all."""
    if (reason := why_torch_compile_cannot_run()) is not None:
        pytest.skip(reason)

    def losses(compile: bool) -> list[float]:
        trainer = tiny_trainer(train_data, tmp_path / f"compile{compile}", precision="bf16", compile=compile,
                               model=ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64,
                                                 heads=2, dropout=0.0))
        step, split = trainer.step, trainer.data.train
        found = []
        for u in range(20):
            i = u % len(split.batches)
            out = step.run([split.batches[i]], int(split.tgt_tokens[i]), u + 1, u + 1, [0.0, 0.0])
            step.zero_grad()
            totals = Totals.read(out.totals.tolist())
            found.append(totals.loss / totals.tgt_tokens)
        shapes = {tuple(step.batches.get(ids)["src"].shape) for ids in split.batches}
        assert all(length % COMPILED_MULTIPLE == 0 for _, length in shapes) == compile, shapes
        return found

    graphs = compiled_graphs()
    eager, compiled = losses(False), losses(True)
    assert 1 <= compiled_graphs() - graphs <= 3
    torch.testing.assert_close(compiled, eager, rtol=5e-3, atol=0)  # bf16 keeps 8 bits: 3.9e-3


def test_compile_without_a_compiler_is_a_clear_error(train_data: Path, tmp_path: Path) -> None:
    """`nmt train --compile` on a CPU with no C++ compiler stops before training, saying what to do
    (torch itself would fail only once its first graph was traced)."""
    proc = nmt("train", train_data, "--save-dir", tmp_path / "run", "--arch", "transformer_tiny", "--compile",
               "--max-update", 2, check=False, env={"CXX": str(tmp_path / "no-such-g++")})
    assert_user_error(proc, "--compile", "C++ compiler", "no-such-g++", "train without --compile")
    assert not list((tmp_path / "run").glob("checkpoint*.pt"))
