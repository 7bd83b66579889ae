"""One training update (section 5): this rank's micro-batches forward and backward, the gradient
all-reduce, and the optimiser step, skipped alike on every rank when some rank saw a non-finite value
or nothing could be trained. What a run survives, and the messages when it cannot, are `guard`'s.

One update = M micro-batches on each of W ranks (corpus.py); its loss is the label-smoothed
cross-entropy summed over every real target token and divided by the update's target tokens
(loss.py), so its gradient does not depend on how the examples were split; Adam with the paper's
schedule (optim.py).
"""

from __future__ import annotations

import contextlib
import math
import resource
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from nmt_cli import hooks
from nmt_cli.config.train import TrainConfig
from nmt_cli.data.dataset import PAD, UNK, collate
from nmt_cli.errors import NmtError
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import corpus, distributed, guard
from nmt_cli.training import optim as optim_lib
from nmt_cli.training.loss import label_smoothed_nll


def micro_batch_loss(model: torch.nn.Module, batch: dict[str, Tensor],
                     epsilon: float) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss, nll) of one micro-batch, summed over its real target tokens."""
    keep = batch["target"] != PAD  # (B, T)
    logits = model(batch["src"], batch["prev"], keep)  # (N, V), only real target positions
    # A model with separate dictionaries scores only the target's (`output_vocab`): a source-only symbol in
    # a reference is an unknown target word to it, as to fairseq.
    target = batch["target"][keep]
    target = target.masked_fill(target >= logits.shape[-1], UNK)
    return label_smoothed_nll(logits, target, epsilon)


class Outcome(NamedTuple):
    """One update as every rank saw it (after the all-reduce), and what this rank trained."""

    applied: bool  # the optimiser stepped
    totals: list[float]  # [0:5] loss, nll, target and source tokens, sentences; [5:8] the ranks'
    # flags (guard.Health); [8:] the caller's flags, summed over ranks
    health: guard.Health
    norm: float  # the gradient norm, before clipping
    lr: float
    trained: list[np.ndarray]  # the example ids of this rank's micro-batches that were trained


class Step:
    """The model and what changes it (the DDP wrapper, the optimiser, the loss scaler) at one
    precision, and the update that changes it."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.Context, data: corpus.Corpus) -> None:
        self.cfg, self.ctx, self.train = cfg, ctx, data.train
        self.precision = distributed.resolve_precision(cfg, ctx.device)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = Transformer(cfg.model, len(data.dictionary)).to(ctx.device)
        self.ddp = distributed.wrap(self.model, ctx)
        self.optimizer = optim_lib.build_optimizer(self.model.parameters(), cfg.optim)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.micro_batches = data.plan.micro_batches  # planned for ctx.world_size ranks (corpus.load)
        # a rank's zero-weight part in the gradient all-reduce
        self.spare = corpus.shortest_example(data.train)

    def autocast(self) -> Any:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=dtype)

    def batch(self, ids: np.ndarray) -> dict[str, Tensor]:
        arrays = collate(self.train.src, self.train.tgt, ids)
        return {k: torch.from_numpy(v).to(self.ctx.device, non_blocking=True)
                for k, v in arrays.items() if k != "ids"}

    def run(self, micro: list[np.ndarray | None], update_tgt_tokens: int, attempt: int, number: int,
            flags: list[float]) -> Outcome:
        """Forward/backward of this rank's micro-batches of update `number` (try `attempt`), then one
        optimiser step unless some rank saw a non-finite value or nothing could be trained. `flags`
        travel in the same all-reduce (the trainer's save and stop decisions). The gradients stay
        until `zero_grad`, for `guard.locate_nonfinite`."""
        cfg, ctx = self.cfg, self.ctx
        sums, dropped, trained = self.forward_backward(micro, update_tgt_tokens, attempt)
        hooks.at("gradients_reduced", attempt=attempt, rank=ctx.rank, model=self.model)
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        finite_here = math.isfinite(float(norm))
        mine = [float(not math.isfinite(sums[0])), float(not finite_here), float(dropped)]
        totals = distributed.all_reduce_sum([*sums, *mine, *flags], ctx)  # every rank decides alike
        health, trained_tgt = guard.Health(*map(int, totals[5:8]), ctx.world_size), totals[2]
        applied = health.finite and trained_tgt > 0
        lr = optim_lib.learning_rate(cfg.optim, cfg.model.d_model, number)
        if applied:
            if trained_tgt < update_tgt_tokens:  # micro-batches were dropped: the mean over what was trained
                for p in params:
                    p.grad.mul_(update_tgt_tokens / trained_tgt)
                norm = norm * (update_tgt_tokens / trained_tgt)
            if cfg.optim.clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.clip_norm, norm)
            optim_lib.set_learning_rate(self.optimizer, lr)
            self.scaler.step(self.optimizer)
        guard.update_loss_scale(self.scaler, health.finite, finite_here)
        return Outcome(applied, totals, health, float(norm), lr, trained)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, micro: list[np.ndarray | None], update_tgt_tokens: int,
                         attempt: int) -> tuple[list[float], int, list[np.ndarray]]:
        """This rank's micro-batches of one update, forward and backward. Returns the sums (loss, nll,
        target and source tokens, sentences) of those trained, how many were dropped for lack of
        memory, and the ids of those trained."""
        ctx = self.ctx
        sums = torch.zeros(5, dtype=torch.float64, device=ctx.device)
        dropped, trained = 0, []
        for i, ids in enumerate(micro):
            sync, at = i == len(micro) - 1, (attempt, i + 1)
            # dividing by the update's target tokens (all ranks) times W undoes DDP's mean over ranks
            weight = 0.0 if ids is None else ctx.world_size / update_tgt_tokens
            with distributed.gradient_sync(self.ddp, sync):
                out = self._forward(self.spare if ids is None else ids, at)
                if out is None and ids is not None:
                    dropped += 1
                    if not (sync and ctx.distributed):
                        continue
                    ids, weight = None, 0.0  # still join the gradient all-reduce, at weight zero
                    out = self._forward(self.spare, None)
                if out is None:
                    raise guard.out_of_memory_in_sync(self.cfg, ctx.rank)
                if not self._backward(out[0] * weight, sync, at):
                    # the gradients hold a part of it: start afresh
                    dropped, trained = dropped + len(trained) + 1, []
                    sums.zero_()
                    self.zero_grad()
                    continue
            if ids is not None:
                trained.append(ids)
                sums += torch.stack([*out, torch.tensor(len(ids), dtype=torch.float64, device=sums.device)])
        return sums.tolist(), dropped, trained

    def _forward(self, ids: np.ndarray, at: tuple[int, int] | None) -> list[Tensor] | None:
        """[loss, nll, target tokens, source tokens] of one micro-batch (the loss with its graph, the
        rest float64), or None when it ran out of memory. `at`: (attempt, micro-batch) for the hooks."""
        try:
            batch = self.batch(ids)
            with self.autocast():  # the forward only, as torch.amp recommends
                loss, nll = micro_batch_loss(self.ddp, batch, self.cfg.optim.label_smoothing)
            if at is not None:
                replaced = hooks.at("forward_done", attempt=at[0], micro=at[1], rank=self.ctx.rank, loss=loss)
                loss = loss if replaced is None else replaced
            return [loss, nll.double(), (batch["target"] != PAD).sum().double(),
                    (batch["src"] != PAD).sum().double()]
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not guard.is_out_of_memory(e):
                raise
        guard.free_cached_memory(self.ctx.device)  # the failed graph went with the exception
        return None

    def _backward(self, loss: Tensor, sync: bool, at: tuple[int, int] | None) -> bool:
        """Backward of one micro-batch; False when it ran out of memory part-way."""
        try:
            self.scaler.scale(loss).backward()
            if at is not None:
                hooks.at("backward_done", attempt=at[0], micro=at[1], rank=self.ctx.rank)
            return True
        except RuntimeError as e:
            if not guard.is_out_of_memory(e):
                raise
            if sync and self.ctx.distributed:  # DDP's all-reduces have started: the others wait for ours
                raise guard.out_of_memory_in_sync(self.cfg, self.ctx.rank) from None
        guard.free_cached_memory(self.ctx.device)
        return False

    def try_largest_batch(self) -> str:
        """The dry run's memory check: forward, backward and one optimiser step (learning rate 0) of
        the largest batches on one device, as a worker would run them. A report, or an NmtError when
        one does not fit."""
        cfg, device = self.cfg, self.ctx.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i, ids in enumerate(corpus.largest_batches(self.train), start=1):
            out = self._forward(ids, (0, i))
            if out is None or not self._backward(out[0] / max(float(out[2]), 1.0), True, (0, i)):
                tokens = int(self.train.tgt.sizes[ids].sum()) + len(ids)
                raise NmtError(f"a batch of {len(ids)} sentences ({tokens} target tokens) does not fit in "
                               f"the memory of {device} with batch.max_tokens={cfg.batch.max_tokens} and "
                               f"precision {self.precision}: lower --max-tokens (tokens_per_update stays)")
            self.scaler.step(self.optimizer)  # allocates Adam's moments; a learning rate of 0 moves nothing
            self.scaler.update()
            self.zero_grad()
        gradients = sum(p.numel() * 4 for p in self.model.parameters()) / 2**20
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            used = (f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB "
                    f"of {total / 2**30:.1f} GiB")
        else:  # ru_maxrss is in KiB on Linux
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            used = f"peak resident memory of this process {rss:.2f} GiB"
        return (f"largest batch: fits on {device} (forward, backward and optimizer step; batch.max_tokens="
                f"{cfg.batch.max_tokens}, precision {self.precision}): {used}; under DDP each GPU also holds "
                f"about {gradients:,.0f} MiB of gradient buckets")
