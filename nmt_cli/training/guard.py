"""What keeps a days-long `nmt train` alive: updates with non-finite values, micro-batches that run
out of memory, workers that drift apart. `step.Step` meets them; this module decides what a run
survives and says why it stops.

Non-finite values. Each rank flags a non-finite loss sum and a non-finite gradient norm (taken after
the gradient all-reduce). The flags travel in the one all-reduce each update already makes, before
the optimiser step, so every rank takes the same decision even when only one saw the NaN (a loss is
local to its rank). A flagged update is skipped: no optimiser step, its batches are spent, the
update number stays. The device takes that decision (fused Adam's `found_inf`); the host learns it
at its next sync point, a log line at the latest (`train.Trainer._settle`), and takes each update in
turn as it happened. More than `guard.max_bad_updates` in a row stop the run with a message that names
the update, the first parameter or gradient in module order holding a non-finite value (searched on
every rank; gradients by the norms the step kept of them), and the last checkpoint. With fp16 a
skipped update also shrinks the loss scale on every rank (GradScaler's backoff), and a scale below
`guard.min_loss_scale` stops the run; the host reads each fp16 update at once, as the scale is its.

Out of memory. Only the update's last micro-batch runs the backward pass that all-reduces the
gradients (DDP); the others accumulate locally. A micro-batch whose forward or (local) backward runs
out of memory is dropped on that rank alone: after a backward that failed part-way the rank's
accumulated gradients are zeroed and its earlier micro-batches of the update are dropped too, as
their sum is no longer known. A rank whose last micro-batch fails in the forward still joins the
synchronising backward, with a one-sentence batch at weight zero, so no rank waits in an all-reduce
another will never join. The counts travel in the same all-reduce; the gradient is rescaled to the
target tokens actually trained, and the update is skipped when none were. More than
`guard.max_oom_fraction` of the micro-batches so far stop the run with a message naming --max-tokens.
One case cannot be recovered: running out of memory inside the synchronising backward of several
workers, where DDP has already started all-reduces the other ranks are waiting on. That rank stops
the run with the same clear message (torchrun then stops the others) rather than hang them.

Replicas. DDP keeps every rank's weights bitwise equal; at each checkpoint the ranks compare a
fingerprint of their weights, loss scale and update number, and stop on any difference instead of
saving a state that only rank 0 has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from nmt_cli.config.train import TrainConfig
from nmt_cli.errors import NmtError
from nmt_cli.training import distributed
from nmt_cli.training.counters import Counters

if TYPE_CHECKING:
    from nmt_cli.training.trainlog import TrainLog


# ---------------------------------------------------------------------------------------------
# Micro-batches that run out of memory


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator's ("can't allocate memory")."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def free_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory_in_sync(cfg: TrainConfig, rank: int) -> NmtError:
    return NmtError(f"out of memory in the gradient-synchronising backward pass on rank {rank} "
                    f"(batch.max_tokens={cfg.batch.max_tokens}): the other workers are already exchanging "
                    "gradients, so this micro-batch cannot be skipped. Lower --max-tokens (tokens_per_update "
                    "stays) and rerun the same command to resume from checkpoint_last.pt")


def check_out_of_memory(cfg: TrainConfig, c: Counters, saved_update: int) -> None:
    """Stop when more than `guard.max_oom_fraction` of the micro-batches so far were dropped (one
    never does)."""
    if c.oom_micro_batches > max(1.0, cfg.guard.max_oom_fraction * c.micro_batches):
        raise NmtError(f"update {c.update + 1}: {c.oom_micro_batches} of {c.micro_batches} micro-batches "
                       "so far ran out of memory and were skipped, more than "
                       f"guard.max_oom_fraction={cfg.guard.max_oom_fraction:g}. Lower --max-tokens (now "
                       f"{cfg.batch.max_tokens}; tokens_per_update stays, with more micro-batches "
                       f"per update) and rerun to resume; {last_checkpoint(cfg, saved_update)}")


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
        limit = (f"fp16 loss scale now {scaler.get_scale():g}, "
                 f"the run stops below {cfg.guard.min_loss_scale:g}"
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
        raise NmtError(f"update {attempt}: the fp16 loss scale fell to {scale:g}, below guard.min_loss_scale="
                       f"{cfg.guard.min_loss_scale:g}: the gradients overflow again and again "
                       f"({health.describe()}; {where()}). Train with --precision bf16 or fp32, or lower the "
                       f"learning rate; {last_checkpoint(cfg, saved_update)}")
    if scale is None and c.bad_updates > cfg.guard.max_bad_updates:
        raise NmtError(f"update {attempt}: {c.bad_updates} updates in a row were skipped for non-finite "
                       f"values (this one: {health.describe()}); {where()}. Lower the learning rate "
                       f"(or raise warmup_updates) and rerun to resume; {last_checkpoint(cfg, saved_update)}")


def locate_nonfinite(model: nn.Module, ctx: distributed.Context,
                     bad_gradients: set[str] | None = None) -> str:
    """Where the first non-finite value is, searched on every rank (a collective: all ranks call it).
    `bad_gradients`: the parameters whose gradients were not finite (`Step.nonfinite_gradients`),
    when the gradients of that update are gone."""
    found = distributed.all_gather(first_nonfinite(model, bad_gradients), ctx)
    for rank, where in enumerate(found):
        if where is not None:
            return f"the first non-finite values in module order are in {where}" + (
                f" on rank {rank}" if ctx.distributed else "")
    return "no parameter or gradient holds a non-finite value: the loss itself was (look at the data)"


def first_nonfinite(model: nn.Module, bad_gradients: set[str] | None = None) -> str | None:
    """The first parameter or gradient, in module order, that holds a NaN or an infinity, named;
    the gradients are the model's own unless `bad_gradients` names those that were."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return f"{name} (its value)"
        if bad_gradients is not None:
            if name in bad_gradients:
                return f"{name} (its gradient)"
        elif p.grad is not None and not bool(torch.isfinite(p.grad).all()):
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
    differing = [rank for rank, other in enumerate(prints)
                 if not np.array_equal(other, prints[0], equal_nan=True)]
    if differing:
        raise NmtError(f"update {update}: the workers' weights have drifted apart (rank(s) {differing} "
                       "differ from rank 0), which DDP never allows: a bug or a hardware fault. Rerun to "
                       "resume from the last checkpoint, and report it if it happens again")


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
            raise NmtError(f"out of memory outside a training micro-batch (validation, an optimizer step) "
                           f"with batch.max_tokens={cfg.batch.max_tokens} on {ctx.device}: lower "
                           "--max-tokens (tokens_per_update stays) and rerun the same command to resume "
                           "from checkpoint_last.pt") from None
    except NmtError as e:
        if ctx.is_main:
            raise
        time.sleep(5)
        print(f"error (rank {ctx.rank}): {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception as e:
        if not (ctx.distributed and distributed.lost_peer(e)):
            raise
        print(f"error (rank {ctx.rank}): lost contact with another worker, which stopped (its output says "
              f"why; here: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); rerun the same "
              f"command, or use --max-restarts, to resume from {cfg.save_dir}/checkpoint_last.pt",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
