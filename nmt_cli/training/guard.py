"""What keeps a days-long `nmt train` alive: updates with non-finite values, micro-batches that run
out of memory, workers that drift apart, and the test-only hooks that inject such faults.

Non-finite values. Each rank flags a non-finite loss sum and a non-finite gradient norm (taken after
the gradient all-reduce). The flags travel in the one all-reduce each update already makes, before
the optimiser step, so every rank takes the same decision even when only one saw the NaN (a loss is
local to its rank). A flagged update is skipped: no optimiser step, its batches are spent, the
update number stays. More than `max_bad_updates` in a row stop the run with a message that names the
update, the first parameter or gradient in module order holding a non-finite value (searched on
every rank), and the last checkpoint. With fp16 a skipped update also shrinks the loss scale on
every rank (GradScaler's backoff), and a scale below `min_loss_scale` stops the run.

Out of memory. Only the update's last micro-batch runs the backward pass that all-reduces the
gradients (DDP); the others accumulate locally. A micro-batch whose forward or (local) backward runs
out of memory is dropped on that rank alone: after a backward that failed part-way the rank's
accumulated gradients are zeroed and its earlier micro-batches of the update are dropped too, as
their sum is no longer known. A rank whose last micro-batch fails in the forward still joins the
synchronising backward, with a one-sentence batch at weight zero, so no rank waits in an all-reduce
another will never join. The counts travel in the same all-reduce; the gradient is rescaled to the
target tokens actually trained, and the update is skipped when none were. More than
`max_oom_fraction` of the micro-batches so far stop the run with a message naming --max-tokens.
One case cannot be recovered: running out of memory inside the synchronising backward of several
workers, where DDP has already started all-reduces the other ranks are waiting on. That rank stops
the run with the same clear message (torchrun then stops the others) rather than hang them.

Replicas. DDP keeps every rank's weights bitwise equal; at each checkpoint the ranks compare a
fingerprint of their weights, loss scale and update number, and stop on any difference instead of
saving a state that only rank 0 has.

Test-only hooks (environment variables; never set outside tests):

- ``NMT_TEST_FAULTS``: space-separated faults ``KIND@A[-B][.M][/R]``: on update attempts A..B (every
  update tried counts, skipped ones too, from 1; 0 is the dry run's largest-batch trial), micro-batch
  M (from 1; any when left out), rank R (every rank when left out). KIND is ``loss`` (the loss
  becomes NaN, its gradient stays finite), ``grad`` (after the gradient all-reduce, one value of the
  gradient of the model's last parameter becomes +inf on that rank only), ``oom`` (a
  torch.OutOfMemoryError after the micro-batch's forward) or ``oom-backward`` (after its backward).
- ``NMT_TEST_PID_DIR``: each worker writes its process id to ``rank{R}.restart{N}.pid`` there.
- ``NMT_TEST_SAVE_PAUSE_SECONDS`` (checkpoint.py) and ``NMT_TEST_EXAMPLE_LOG`` (train.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from nmt_cli.config.train import TrainConfig
from nmt_cli.data.dataset import PAD
from nmt_cli.errors import NmtError
from nmt_cli.training import corpus, distributed
from nmt_cli.training.resume import Counters

if TYPE_CHECKING:
    from nmt_cli.training.train import Trainer
    from nmt_cli.training.trainlog import TrainLog

_FAULT = re.compile(r"(loss|grad|oom|oom-backward)@(\d+)(?:-(\d+))?(?:\.(\d+))?(?:/(\d+))?")


# ---------------------------------------------------------------------------------------------
# Micro-batches that run out of memory


def forward_backward(trainer: Trainer, micro: list[np.ndarray | None], update_tgt_tokens: int,
                     attempt: int) -> tuple[list[float], int]:
    """This rank's micro-batches of one update, forward and backward. Returns the sums (loss, nll,
    target and source tokens, sentences) of those trained and how many were dropped for lack of memory."""
    ctx = trainer.ctx
    sums = torch.zeros(5, dtype=torch.float64, device=ctx.device)
    dropped, trained = 0, []
    for i, ids in enumerate(micro):
        sync, fault_at = i == len(micro) - 1, (attempt, i + 1)
        # dividing by the update's target tokens (all ranks) times W undoes DDP's mean over ranks
        weight = 0.0 if ids is None else ctx.world_size / update_tgt_tokens
        with distributed.gradient_sync(trainer.ddp, sync):
            out = _forward(trainer, trainer.spare if ids is None else ids, fault_at)
            if out is None and ids is not None:
                dropped += 1
                if not (sync and ctx.distributed):
                    continue
                ids, weight = None, 0.0  # still join the gradient all-reduce, at weight zero
                out = _forward(trainer, trainer.spare, None)
            if out is None:
                raise out_of_memory_in_sync(trainer.cfg, ctx.rank)
            if not _backward(trainer, out[0] * weight, sync, fault_at):
                dropped, trained = dropped + len(trained) + 1, []  # the gradients hold a part of it: start afresh
                sums.zero_()
                trainer.optimizer.zero_grad(set_to_none=True)
                continue
        if ids is not None:
            trained.append(ids)
            sums += torch.stack([*out, torch.tensor(len(ids), dtype=torch.float64, device=sums.device)])
    for ids in trained:
        trainer.note_examples(ids)
    return sums.tolist(), dropped


def _forward(trainer: Trainer, ids: np.ndarray, fault_at: tuple[int, int] | None) -> list[Tensor] | None:
    """[loss, nll, target tokens, source tokens] of one micro-batch (the loss with its graph, the rest
    float64), or None when it ran out of memory."""
    try:
        batch = trainer.batch(ids)
        loss, nll = trainer.forward_loss(batch)
        if fault_at is not None:
            trainer.faults.out_of_memory("forward", *fault_at)
            loss = trainer.faults.poison_loss(loss, fault_at[0])
        return [loss, nll.double(), (batch["target"] != PAD).sum().double(), (batch["src"] != PAD).sum().double()]
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(e):
            raise
    free_cached_memory(trainer.ctx.device)  # the failed graph went with the exception
    return None


def _backward(trainer: Trainer, loss: Tensor, sync: bool, fault_at: tuple[int, int] | None) -> bool:
    """Backward of one micro-batch; False when it ran out of memory part-way."""
    try:
        trainer.scaler.scale(loss).backward()
        if fault_at is not None:
            trainer.faults.out_of_memory("backward", *fault_at)
        return True
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        if sync and trainer.ctx.distributed:  # DDP's all-reduces have started: the others wait for ours
            raise out_of_memory_in_sync(trainer.cfg, trainer.ctx.rank) from None
    free_cached_memory(trainer.ctx.device)
    return False


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator's ("can't allocate memory")."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def free_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory_in_sync(cfg: TrainConfig, rank: int) -> NmtError:
    return NmtError(f"out of memory in the gradient-synchronising backward pass on rank {rank} (max_tokens="
                    f"{cfg.batch.max_tokens}): the other workers are already exchanging gradients, so this micro-batch "
                    "cannot be skipped. Lower --max-tokens (tokens_per_update stays) and rerun the same command "
                    "to resume from checkpoint_last.pt")


def check_out_of_memory(cfg: TrainConfig, c: Counters, saved_update: int) -> None:
    """Stop when more than `max_oom_fraction` of the micro-batches so far were dropped (one never does)."""
    if c.oom_micro_batches > max(1.0, cfg.guard.max_oom_fraction * c.micro_batches):
        raise NmtError(f"update {c.update + 1}: {c.oom_micro_batches} of {c.micro_batches} micro-batches so far "
                       f"ran out of memory and were skipped, more than max_oom_fraction={cfg.guard.max_oom_fraction:g}. "
                       f"Lower --max-tokens (now {cfg.batch.max_tokens}; tokens_per_update stays, with more micro-batches "
                       f"per update) and rerun to resume; {last_checkpoint(cfg, saved_update)}")


def try_largest_batch(trainer: Trainer) -> str:
    """The dry run's memory check: forward, backward and one optimiser step (learning rate 0) of the
    largest batches on one device, as a worker would run them. A report, or an NmtError when one
    does not fit."""
    cfg, device = trainer.cfg, trainer.ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, ids in enumerate(corpus.largest_batches(trainer.data.train), start=1):
        out = _forward(trainer, ids, (0, i))
        if out is None or not _backward(trainer, out[0] / max(float(out[2]), 1.0), True, (0, i)):
            tokens = int(trainer.data.train.tgt.sizes[ids].sum()) + len(ids)
            raise NmtError(f"a batch of {len(ids)} sentences ({tokens} target tokens) does not fit in the memory "
                           f"of {device} with max_tokens={cfg.batch.max_tokens} and precision {trainer.precision}: lower "
                           "--max-tokens (tokens_per_update stays)")
        trainer.scaler.step(trainer.optimizer)  # allocates Adam's moments; a learning rate of 0 moves nothing
        trainer.scaler.update()
        trainer.optimizer.zero_grad(set_to_none=True)
    gradients = sum(p.numel() * 4 for p in trainer.model.parameters()) / 2**20
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB of {total / 2**30:.1f} GiB"
    else:  # ru_maxrss is in KiB on Linux
        used = f"peak resident memory of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    return (f"largest batch: fits on {device} (forward, backward and optimizer step; max_tokens={cfg.batch.max_tokens}, "
            f"precision {trainer.precision}): {used}; under DDP each GPU also holds about {gradients:,.0f} MiB of "
            "gradient buckets")


# ---------------------------------------------------------------------------------------------
# Non-finite values


@dataclasses.dataclass(frozen=True)
class Health:
    """What every rank knows of one update after the all-reduce."""

    loss_bad_ranks: int  # ranks whose loss sum was NaN or infinite
    grad_bad_ranks: int  # ranks whose gradient norm was
    oom_micro_batches: int  # micro-batches dropped for lack of memory, all ranks
    world_size: int

    @property
    def finite(self) -> bool:
        return self.loss_bad_ranks == 0 and self.grad_bad_ranks == 0

    def describe(self) -> str:
        return (f"non-finite loss on {self.loss_bad_ranks} and non-finite gradients on {self.grad_bad_ranks} "
                f"of {self.world_size} rank(s)")


def update_loss_scale(scaler: torch.amp.GradScaler, finite: bool, finite_here: bool) -> None:
    """fp16: GradScaler's own rule where this rank's gradients showed what all ranks decided; where
    only another rank (or a loss) was non-finite, the same backoff by hand: the scales stay equal."""
    if finite or not finite_here or not scaler.is_enabled():
        scaler.update()
    else:
        scaler.update(scaler.get_scale() * scaler.get_backoff_factor())


def report(log: TrainLog, number: int, health: Health, c: Counters, cfg: TrainConfig,
           scaler: torch.amp.GradScaler) -> None:
    """A warning line for a skipped update and for micro-batches dropped for lack of memory."""
    if not health.finite:
        limit = (f"fp16 loss scale now {scaler.get_scale():g}, the run stops below {cfg.guard.min_loss_scale:g}"
                 if scaler.is_enabled() else f"the run stops after {cfg.guard.max_bad_updates}")
        log.warn(f"update {number}: skipped, {health.describe()} ({c.bad_updates} in a row; {limit})")
    if health.oom_micro_batches:
        log.warn(f"update {number}: {health.oom_micro_batches} micro-batch(es) ran out of memory and were "
                 f"skipped ({c.oom_micro_batches} of {c.micro_batches} so far)")


def check_nonfinite(cfg: TrainConfig, c: Counters, health: Health, scale: float | None,
                    where: Callable[[], str], saved_update: int) -> None:
    """Stop the run when skipped updates are no longer a passing accident. `scale` is the fp16 loss
    scale (None otherwise); `where()` locates the non-finite values (a collective, called on all ranks
    alike since they share `health`)."""
    if health.finite:
        return
    attempt = c.update + 1
    if scale is not None and scale < cfg.guard.min_loss_scale:
        raise NmtError(f"update {attempt}: the fp16 loss scale fell to {scale:g}, below min_loss_scale="
                       f"{cfg.guard.min_loss_scale:g}: the gradients overflow again and again ({health.describe()}; "
                       f"{where()}). Train with --precision bf16 or fp32, or lower the learning rate; "
                       f"{last_checkpoint(cfg, saved_update)}")
    if scale is None and c.bad_updates > cfg.guard.max_bad_updates:
        raise NmtError(f"update {attempt}: {c.bad_updates} updates in a row were skipped for non-finite values "
                       f"(this one: {health.describe()}); {where()}. Lower the learning rate (or raise "
                       f"warmup_updates) and rerun to resume; {last_checkpoint(cfg, saved_update)}")


def locate_nonfinite(model: nn.Module, ctx: distributed.Context) -> str:
    """Where the first non-finite value is, searched on every rank (a collective: all ranks call it)."""
    found = distributed.all_gather(first_nonfinite(model), ctx)
    for rank, where in enumerate(found):
        if where is not None:
            return f"the first non-finite values in module order are in {where}" + (
                f" on rank {rank}" if ctx.distributed else "")
    return "no parameter or gradient holds a non-finite value: the loss itself was (look at the data)"


def first_nonfinite(model: nn.Module) -> str | None:
    """The first parameter or gradient, in module order, that holds a NaN or an infinity, named."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return f"{name} (its value)"
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return f"{name} (its gradient)"
    return None


def last_checkpoint(cfg: TrainConfig, saved_update: int) -> str:
    if saved_update < 0:
        return "no checkpoint was saved yet"
    return f"the last good checkpoint is {cfg.save_dir}/checkpoint_last.pt (update {saved_update})"


# ---------------------------------------------------------------------------------------------
# Workers


def check_replicas(model: nn.Module, scale: float, update: int, ctx: distributed.Context) -> None:
    """Stop when the ranks' weights, loss scale or update count differ: under DDP they stay bitwise
    equal, so a difference is a bug or a hardware fault, and saving rank 0's state would hide it."""
    if not ctx.distributed:
        return
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in model.parameters()])
    prints = distributed.all_gather(np.array([update, scale, *sums.tolist()]), ctx)
    differing = [rank for rank, other in enumerate(prints) if not np.array_equal(other, prints[0], equal_nan=True)]
    if differing:
        raise NmtError(f"update {update}: the workers' weights have drifted apart (rank(s) {differing} differ from "
                       "rank 0), which DDP never allows: a bug or a hardware fault. Rerun to resume from the last "
                       "checkpoint, and report it if it happens again")


@contextlib.contextmanager
def worker_errors(cfg: TrainConfig, ctx: distributed.Context) -> Iterator[None]:
    """How a training process ends on an error: out of memory outside a micro-batch becomes the user
    error it is; a worker other than rank 0 reports its user error itself (rank 0 mostly meets the
    same one; torchrun stops the rest); a worker whose peer died says so in one line."""
    try:
        try:
            yield
        except RuntimeError as e:  # micro-batches recover (forward_backward); validation or a step may not
            if not is_out_of_memory(e):
                raise
            raise NmtError(f"out of memory outside a training micro-batch (validation, an optimizer step) with "
                           f"max_tokens={cfg.batch.max_tokens} on {ctx.device}: lower --max-tokens (tokens_per_update "
                           "stays) and rerun the same command to resume from checkpoint_last.pt") from None
    except NmtError as e:
        if ctx.is_main:
            raise
        time.sleep(5)
        print(f"error (rank {ctx.rank}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception as e:
        if not (ctx.distributed and distributed.lost_peer(e)):
            raise
        print(f"error (rank {ctx.rank}): lost contact with another worker, which stopped (its output says why; "
              f"here: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); rerun the same command, or use "
              f"--max-restarts, to resume from {cfg.save_dir}/checkpoint_last.pt", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


# ---------------------------------------------------------------------------------------------
# Test-only hooks


@dataclasses.dataclass
class Faults:
    """The faults a test asked this rank for through NMT_TEST_FAULTS; none otherwise."""

    entries: list[tuple[str, range, int | None]]  # (kind, attempts, micro-batch or None for any)

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        entries = []
        for item in os.environ.get("NMT_TEST_FAULTS", "").split():
            match = _FAULT.fullmatch(item)
            assert match, f"NMT_TEST_FAULTS: {item!r} is not KIND@A[-B][.M][/R]"
            kind, first, last, micro, on_rank = match.groups()
            if on_rank is None or int(on_rank) == rank:
                entries.append((kind, range(int(first), int(last or first) + 1), int(micro) if micro else None))
        return cls(entries)

    def _wanted(self, kind: str, attempt: int, micro: int | None = None) -> bool:
        return any(k == kind and attempt in a and m in (None, micro) for k, a, m in self.entries)

    def poison_loss(self, loss: Tensor, attempt: int) -> Tensor:
        return loss + float("nan") if self._wanted("loss", attempt) else loss

    def poison_gradient(self, model: nn.Module, attempt: int) -> None:
        if self._wanted("grad", attempt):
            with torch.no_grad():
                [p for p in model.parameters() if p.grad is not None][-1].grad.view(-1)[0] = float("inf")

    def out_of_memory(self, phase: str, attempt: int, micro: int) -> None:
        if self._wanted("oom" if phase == "forward" else "oom-backward", attempt, micro):
            raise torch.OutOfMemoryError(f"NMT_TEST_FAULTS: out of memory after the {phase} of micro-batch "
                                         f"{micro} of update attempt {attempt}")


def note_pid_for_tests(rank: int) -> None:
    if folder := os.environ.get("NMT_TEST_PID_DIR"):
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        (Path(folder) / f"rank{rank}.restart{restart}.pid").write_text(str(os.getpid()))
