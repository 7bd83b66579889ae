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
import resource
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from nmt_cli import hooks
from nmt_cli.config.train import TrainConfig
from nmt_cli.data.dataset import PAD, UNK, collate
from nmt_cli.errors import NmtError
from nmt_cli.model.cpu import keep_freed_memory, missing_compiler, no_compiler_message
from nmt_cli.model.transformer import Transformer, build_model
from nmt_cli.training import corpus, distributed, guard
from nmt_cli.training import optim as optim_lib
from nmt_cli.training.loss import label_smoothed_nll


def micro_batch_loss(model: torch.nn.Module, batch: dict[str, Tensor],
                     epsilon: float) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss, nll) of one micro-batch, summed over its real target tokens (`keep`, as
    `collate` finds them; from the padding where a batch lacks it)."""
    target = batch["target"].reshape(-1)
    keep = batch.get("keep")
    if keep is None:
        keep = (target != PAD).nonzero().squeeze(1)
    logits = model(batch["src"], batch["prev"], keep)  # (N, V), only real target positions
    # A model with separate dictionaries scores only the target's (`output_vocab`): a source-only symbol in
    # a reference is an unknown target word to it, as to fairseq.
    target = target.index_select(0, keep)
    target = target.masked_fill(target >= logits.shape[-1], UNK)
    return label_smoothed_nll(logits, target, epsilon)


COMPILED_MULTIPLE = 8  # a compiled model's batches are padded to a multiple of this many positions


def compile_model(model: Transformer, device: torch.device) -> None:
    """Run the model's forward (and so its backward) through torch.compile from now on. Shapes are
    dynamic: after the first batches, a few graphs serve every batch size and length (`compiled_graphs`
    counts them; past dynamo's recompile limit a shape runs eagerly, with torch's warning)."""
    if device.type == "cpu" and (compiler := missing_compiler()) is not None:
        raise NmtError(no_compiler_message(compiler, "train"))
    # On a CPU, the random numbers of dropout come from torch's generator, drawn as `kernels.Dropout`
    # draws them: inductor's own were the compiled step's largest cost (benchmarks/README.md,
    # "Training speed: eager and compiled")
    model.compile(dynamic=True, options={"fallback_random": True} if device.type == "cpu" else None)


def compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Outcome(NamedTuple):
    """One update as every rank saw it, still on the device: the trainer reads it at its next sync
    point (train.py `Trainer._settle`), so that the host never waits for the device in between."""

    totals: Tensor  # float64: the fields of `Totals` in order, each summed over ranks
    norm: Tensor  # the gradient norm over the tokens trained, before clipping
    lr: float
    trained: list[np.ndarray]  # the example ids of this rank's micro-batches that were trained


class Totals(NamedTuple):
    """An update's sums over all ranks, as the host reads them from `Outcome.totals`: one float64
    vector on the device, so that one all-reduce carries them all, in this order."""

    loss: float  # summed label-smoothed loss of the tokens trained
    nll: float  # summed negative log-likelihood
    tgt_tokens: float
    src_tokens: float
    sentences: float
    loss_bad_ranks: float  # ranks whose loss was not finite
    grad_bad_ranks: float  # ranks whose gradients were not finite
    oom_micro_batches: float  # micro-batches dropped for lack of memory
    flags: tuple[float, ...]  # the caller's flags (`Step.run`), last

    @classmethod
    def read(cls, values: list[float]) -> Totals:
        return cls(*values[:FLAGS], tuple(values[FLAGS:]))

    @property
    def applied(self) -> bool:
        """Whether the optimiser stepped: no rank saw a non-finite value and some tokens were trained.
        The device decided the same (`Step.run`)."""
        return self.loss_bad_ranks == 0 and self.grad_bad_ranks == 0 and self.tgt_tokens > 0

    @property
    def trained(self) -> tuple[float, float, float, float, float]:
        """What the training log counts: loss, nll, target and source tokens, sentences."""
        return self.loss, self.nll, self.tgt_tokens, self.src_tokens, self.sentences


# Where each field sits in `Outcome.totals` on the device
LOSS_BAD, GRAD_BAD, TGT, SENTENCES, OOM, FLAGS = map(Totals._fields.index, (
    "loss_bad_ranks", "grad_bad_ranks", "tgt_tokens", "sentences", "oom_micro_batches", "flags"))


class Batches:
    """A split's micro-batches as tensors on the device. The next one is collated on a background
    thread (into pinned memory for a GPU, whose copy then overlaps the computation) while this one
    trains."""

    def __init__(self, split: corpus.Split, device: torch.device, multiple: int = 1) -> None:
        self.split, self.device, self.pin, self.multiple = split, device, device.type == "cuda", multiple
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="nmt-batches")
        self.ahead: tuple[np.ndarray, Future] | None = None

    def prefetch(self, ids: np.ndarray | None) -> None:
        if ids is not None and (self.ahead is None or self.ahead[0] is not ids):
            self.ahead = (ids, self.pool.submit(self._host, ids))

    def get(self, ids: np.ndarray) -> dict[str, Tensor]:
        if self.ahead is not None and self.ahead[0] is ids:
            host, self.ahead = self.ahead[1].result(), None
        else:
            host = self._host(ids)
        return {k: t.to(self.device, non_blocking=True) for k, t in host.items()}

    def _host(self, ids: np.ndarray) -> dict[str, Tensor]:
        arrays = collate(self.split.src, self.split.tgt, ids, self.multiple)
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items() if k != "ids"}
        return {k: t.pin_memory() for k, t in tensors.items()} if self.pin else tensors


class Step:
    """The model and what changes it (the DDP wrapper, the optimiser, the loss scaler) at one
    precision, and the update that changes it."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.Context, data: corpus.Corpus) -> None:
        self.cfg, self.ctx, self.train = cfg, ctx, data.train
        self.precision = distributed.resolve_precision(cfg, ctx.device)
        if ctx.device.type == "cpu":  # an update allocates and frees tens of MB (`keep_freed_memory`)
            keep_freed_memory()
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = build_model(cfg.model, data.dictionary).to(ctx.device)
        self.ddp = distributed.wrap(self.model, ctx)
        self.optimizer = optim_lib.build_optimizer(self.model.parameters(), cfg.optim)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.micro_batches = data.plan.micro_batches  # planned for ctx.world_size ranks (corpus.load)
        # a rank's zero-weight part in the gradient all-reduce
        self.spare = corpus.shortest_example(data.train)
        if cfg.compile:
            compile_model(self.model, ctx.device)
        self.batches = Batches(data.train, ctx.device, COMPILED_MULTIPLE if cfg.compile else 1)
        # each parameter's gradient norm in the last update whose gradients were not finite here
        self.bad_norms: tuple[list[str], Tensor] | None = None

    def autocast(self) -> Any:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=dtype)

    def run(self, micro: list[np.ndarray | None], update_tgt_tokens: int, attempt: int, number: int,
            flags: list[float], upcoming: np.ndarray | None = None) -> Outcome:
        """Forward/backward of this rank's micro-batches of update `number` (try `attempt`), then one
        optimiser step unless some rank saw a non-finite value or nothing could be trained. `flags`
        travel in the same all-reduce (the trainer's save and stop decisions); `upcoming` is the
        next update's first micro-batch, collated meanwhile. The device takes every decision (fused
        Adam skips the step on its `found_inf` flag): nothing here waits for it, except under fp16,
        whose loss scale follows what the host decides."""
        cfg, ctx = self.cfg, self.ctx
        sums, sentences, dropped, trained = self.forward_backward(micro, update_tgt_tokens, attempt, upcoming)
        hooks.at("gradients_reduced", attempt=attempt, rank=ctx.rank, model=self.model)
        self.scaler.unscale_(self.optimizer)
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        grads = [g for _, g in named]
        norms = torch.stack(torch._foreach_norm(grads)) if grads else torch.zeros(0, device=ctx.device)
        norm = torch.linalg.vector_norm(norms)  # as torch.nn.utils.get_total_norm
        finite_here = torch.isfinite(norm)
        self._remember_nonfinite([n for n, _ in named], norms, finite_here)
        totals = torch.zeros(FLAGS + len(flags), dtype=torch.float64, device=ctx.device)
        totals[:4] = sums  # loss, nll, target and source tokens
        totals[LOSS_BAD] = ~torch.isfinite(sums[0])
        totals[GRAD_BAD] = ~finite_here
        for i, value in ((SENTENCES, sentences), (OOM, dropped), *enumerate(flags, start=FLAGS)):
            totals[i].fill_(value)  # a number into a kernel argument, not a copy from the host
        distributed.all_reduce_(totals, ctx)  # every rank decides alike
        skip = (totals[LOSS_BAD] > 0) | (totals[GRAD_BAD] > 0) | (totals[TGT] == 0)  # as `Totals.applied`
        # Micro-batches were dropped when fewer tokens were trained than planned: the mean over those
        # trained. Then clipping; one multiplication for both (share 1 leaves it bitwise as before).
        share = (update_tgt_tokens / totals[TGT].clamp(min=1)).float()
        norm = norm * share
        if cfg.optim.clip_norm > 0:
            share = share * (cfg.optim.clip_norm / (norm + 1e-6)).clamp(max=1.0)
        if grads:  # none when every micro-batch ran out of memory
            torch._foreach_mul_(grads, share)
        lr = optim_lib.learning_rate(cfg.optim, cfg.model.d_model, number)
        optim_lib.set_learning_rate(self.optimizer, lr)
        if self.scaler.is_enabled():  # fp16: GradScaler steps and scales by what the host reads now
            if not bool(skip):
                self.scaler.step(self.optimizer)
            finite = (totals[LOSS_BAD] == 0) & (totals[GRAD_BAD] == 0)
            guard.update_loss_scale(self.scaler, bool(finite), bool(finite_here))
        else:
            self.optimizer.found_inf = skip.float()  # 1.0: fused Adam leaves everything as it was
            self.scaler.step(self.optimizer)  # (disabled: the optimiser's own step)
            del self.optimizer.found_inf
        return Outcome(totals, norm, lr, trained)

    def _remember_nonfinite(self, names: list[str], norms: Tensor, finite_here: Tensor) -> None:
        """Keep each parameter's gradient norm of the last update whose gradients were not finite on
        this rank, on the device: `nonfinite_gradients` names them when the run stops for it, after
        the gradients themselves are gone."""
        same = self.bad_norms is not None and self.bad_norms[0] == names
        kept = self.bad_norms[1] if same else torch.zeros_like(norms)
        self.bad_norms = (names, torch.where(finite_here, kept, norms))

    def nonfinite_gradients(self) -> set[str]:
        """The parameters whose gradient held a NaN or an infinity in the last update where any did."""
        if self.bad_norms is None:
            return set()
        names, norms = self.bad_norms
        return {n for n, finite in zip(names, torch.isfinite(norms).tolist(), strict=True) if not finite}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, micro: list[np.ndarray | None], update_tgt_tokens: int, attempt: int,
                         upcoming: np.ndarray | None = None) -> tuple[Tensor, int, int, list[np.ndarray]]:
        """This rank's micro-batches of one update, forward and backward. Returns the sums (loss, nll,
        target and source tokens; float64 on the device) and the sentences of those trained, how many
        were dropped for lack of memory, and the ids of those trained."""
        ctx = self.ctx
        sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)
        sentences, dropped, trained = 0, 0, []
        for i, ids in enumerate(micro):
            sync, at = i == len(micro) - 1, (attempt, i + 1)
            self.batches.prefetch(upcoming if sync else micro[i + 1])
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
                    dropped, trained, sentences = dropped + len(trained) + 1, [], 0
                    sums.zero_()
                    self.zero_grad()
                    continue
            if ids is not None:
                trained.append(ids)
                sentences += len(ids)
                sums += torch.stack([out[0].detach().double(), *out[1:]])
        return sums, sentences, dropped, trained

    def _forward(self, ids: np.ndarray, at: tuple[int, int] | None) -> list[Tensor] | None:
        """[loss, nll, target tokens, source tokens] of one micro-batch (the loss with its graph, the
        rest float64), or None when it ran out of memory. `at`: (attempt, micro-batch) for the hooks."""
        try:
            batch = self.batches.get(ids)
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
