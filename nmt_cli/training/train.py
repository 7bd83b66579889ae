"""`nmt train`: the paper's training (section 5) on one process or torchrun workers, resumable exactly.

`run(cfg)` launches torchrun when several devices take part (see `distributed`), or trains here.
One update = M micro-batches on each of W ranks (corpus.py); its loss is the label-smoothed
cross-entropy summed over every real target token and divided by the update's target tokens
(loss.py); Adam with the paper's schedule (optim.py). Checkpoints hold everything needed to
continue bit for bit: rerunning the same command resumes from the newest intact checkpoint
(checkpoint.py). Non-finite values and micro-batches that run out of memory are skipped alike on
every rank, within limits (guard.py).

Run as ``python -m nmt_cli.training.train ARGS`` (what torchrun starts) it is the `nmt train` command.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nmt_cli.artifacts import atomic_write_text
from nmt_cli.config.core import dump_yaml
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.train import TrainConfig
from nmt_cli.data.dataset import EOS, PAD, collate
from nmt_cli.errors import NmtError
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import checkpoint, corpus, distributed, guard
from nmt_cli.training import optim as optim_lib
from nmt_cli.training.loss import label_smoothed_nll, per_token
from nmt_cli.training.resume import Counters, apply_resume, rng_state, training_checkpoint
from nmt_cli.training.trainlog import JSONL, TrainLog, truncate_after


def run(cfg: TrainConfig) -> None:
    if cfg.checkpoint.best_metric == "bleu" and not cfg.valid.bleu:
        raise NmtError("checkpoint.best_metric=bleu needs validation BLEU: add --valid-bleu")
    if cfg.try_largest_batch and not cfg.dry_run:
        raise NmtError("try_largest_batch is a part of the dry run: add --dry-run")
    if cfg.dry_run:
        return print_plan(cfg)
    if distributed.in_worker():
        return train(cfg)
    nproc = distributed.processes_per_node(cfg)
    if nproc > 1 or cfg.launch.nnodes > 1:
        return distributed.launch(cfg, nproc)
    train(cfg)


def train(cfg: TrainConfig) -> None:
    """Train in this process (a torchrun worker, or the only process)."""
    ctx = distributed.setup(cfg)
    guard.note_pid_for_tests(ctx.rank)
    log = TrainLog(cfg.save_dir, ctx.is_main, cfg.log.tensorboard_dir)
    try:
        with guard.worker_errors(cfg, ctx):
            if cfg.threads > 0:
                torch.set_num_threads(cfg.threads)
            trainer = Trainer(cfg, ctx, corpus.load(cfg), log)
            trainer.start()
            trainer.loop()
    finally:
        log.close()
    distributed.teardown(ctx)


def micro_batch_loss(model: torch.nn.Module, batch: dict[str, Tensor], epsilon: float) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss, nll) of one micro-batch, summed over its real target tokens."""
    keep = batch["target"] != PAD  # (B, T)
    logits = model(batch["src"], batch["prev"], keep)  # (N, V), only real target positions
    return label_smoothed_nll(logits, batch["target"][keep], epsilon)


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: distributed.Context, data: corpus.Corpus, log: TrainLog) -> None:
        self.cfg, self.ctx, self.data, self.log = cfg, ctx, data, log
        self.precision = distributed.resolve_precision(cfg, ctx.device)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = Transformer(cfg.model, len(data.dictionary)).to(ctx.device)
        self.ddp = distributed.wrap(self.model, ctx)
        self.optimizer = optim_lib.build_optimizer(self.model.parameters(), cfg.optim)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.micro_batches = corpus.micro_batches_per_update(cfg.batch, data.train, ctx.world_size)
        self.counters = Counters()
        self.saved_update = -1
        self.interval = _Interval()
        self.save_due = False
        self.run_start = self.last_save = time.monotonic()
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)  # dropout differs between ranks
        self.spare = corpus.shortest_example(data.train)  # a rank's zero-weight part in the gradient all-reduce
        self.faults = guard.Faults.from_env(ctx.rank)  # tests only (guard.py)
        self.example_log = os.environ.get("NMT_TEST_EXAMPLE_LOG")  # tests: which examples each rank saw

    def autocast(self) -> Any:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=dtype)

    def forward_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        with self.autocast():  # the forward only, as torch.amp recommends
            return micro_batch_loss(self.ddp, batch, self.cfg.optim.label_smoothing)

    # -- start / resume -------------------------------------------------------------------------

    def start(self) -> None:
        cfg, log = self.cfg, self.log
        save_dir = Path(cfg.save_dir)
        if self.ctx.is_main:
            save_dir.mkdir(parents=True, exist_ok=True)
            for tmp in checkpoint.remove_temporaries(save_dir):
                log.warn(f"removed {tmp}, left by a save that was interrupted")
        found = checkpoint.load_latest(save_dir)
        resumed = -1 if found is None else found[1]["train"]["update"]
        if distributed.broadcast(resumed, self.ctx) != resumed:
            raise NmtError(f"the workers see different checkpoints in {save_dir}; every node must use the "
                           "same shared --save-dir")
        if found is not None:
            path, state, problems = found
            for problem in problems:
                log.warn(f"{problem}; skipped it")
            try:
                notes = apply_resume(self, state)
            except (KeyError, TypeError, ValueError, IndexError) as e:  # a valid checksum over an unknown layout
                raise NmtError(f"{path} has a training state this nmt cannot resume from ({type(e).__name__}: {e}); "
                               "was it written by another nmt version? Use another --save-dir, or move the "
                               "checkpoints away to start afresh") from None
            for note in notes:
                log.warn(note)
            self.saved_update = self.counters.update
            if self.ctx.is_main and path.name != checkpoint.LAST:
                checkpoint.copy_to_last(path)
            if self.ctx.is_main and state["meta"].get("best"):
                checkpoint.relink_best(save_dir, self.counters.update)
            log.info(f"resuming from {path} at update {self.counters.update} (epoch {self.counters.epoch}, "
                     f"{self.counters.epoch_batches_done} of {len(self.data.train.batches)} batches done)")
        if self.ctx.is_main:
            truncate_after(save_dir / JSONL, self.counters.update)
            atomic_write_text(save_dir / "config.yaml", dump_yaml(cfg))
        self._report_plan()

    def _report_plan(self) -> None:
        split, cfg = self.data.train, self.cfg
        for name, part in (("training", split), ("validation", self.data.valid)):
            if part.skipped:
                self.log.warn(f"skipped {part.skipped} of {len(part.src)} {name} examples longer than "
                              f"{min(cfg.model.max_positions, cfg.batch.max_tokens)} tokens (max_positions, max_tokens)")
        self.log.info(f"parameters={sum(p.numel() for p in self.model.parameters())} devices={self.ctx.world_size} "
                      f"device={self.ctx.device.type} precision={self.precision} max_tokens={cfg.batch.max_tokens} "
                      f"micro_batches_per_update={self.micro_batches} batches_per_epoch={len(split.batches)}")

    # -- the loop ---------------------------------------------------------------------------------

    def loop(self) -> None:
        cfg, c = self.cfg, self.counters
        if self._finished():
            self.log.info(f"already trained to update {c.update}, epoch {c.epoch}; nothing to do "
                          "(raise --max-update / --max-epoch to train on)")
            return
        self.log.start(c.update, cfg.stop.max_update or None)
        self.run_start, self.last_save = time.monotonic() - c.train_seconds, time.monotonic()
        self.interval.reset(c.log_sums)
        while not self._finished():
            if not self._epoch():
                break
        self._save()

    def _finished(self) -> bool:
        c, cfg = self.counters, self.cfg
        out_of_time = cfg.stop.max_time_hours > 0 and c.train_seconds >= cfg.stop.max_time_hours * 3600
        return bool((cfg.stop.max_update and c.update >= cfg.stop.max_update) or (cfg.stop.max_epoch and c.epoch > cfg.stop.max_epoch)
                    or c.stop_requested or out_of_time)

    def _epoch(self) -> bool:
        """Train on the rest of the current epoch; False when a stop condition ended it early."""
        c, split, W, M = self.counters, self.data.train, self.ctx.world_size, self.micro_batches
        order = corpus.order_of(split, c.epoch, self.cfg.seed)
        start = c.epoch_batches_done
        for u in range(corpus.updates_per_epoch(len(split.batches), W, M, start)):
            positions = corpus.update_positions(start, u, W, M, len(split.batches))
            micro = corpus.rank_micro_batches(split, order, positions, self.ctx.rank, W, M)
            _, tgt_tokens = corpus.update_tokens(split, order, positions)
            applied = self.update(micro, tgt_tokens, len(positions))
            c.epoch_batches_done = positions.stop
            self._after_update(applied)
            if self._finished():
                return False
        c.epoch, c.epoch_batches_done = c.epoch + 1, 0
        return True

    def update(self, micro: list[np.ndarray | None], update_tgt_tokens: int, planned: int) -> bool:
        """Forward/backward of this rank's micro-batches, then one optimiser step unless some rank saw a
        non-finite value or nothing could be trained (guard.py). True when the step was taken."""
        cfg, c, ctx = self.cfg, self.counters, self.ctx
        attempt, number = c.update + c.skipped_updates + 1, c.update + 1
        sums, dropped = guard.forward_backward(self, micro, update_tgt_tokens, attempt)
        self.faults.poison_gradient(self.model, attempt)
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        finite_here = math.isfinite(float(norm))
        flags = [float(not math.isfinite(sums[0])), float(not finite_here), float(dropped)]
        # [0:5] sums, [5:8] the ranks' flags, [8:10] save due, out of time: every rank decides alike
        totals = distributed.all_reduce_sum([*sums, *flags, *self._time_flags()], ctx)
        health, trained_tgt = guard.Health(*map(int, totals[5:8]), ctx.world_size), totals[2]
        applied, lr = health.finite and trained_tgt > 0, optim_lib.learning_rate(cfg.optim, cfg.model.d_model, c.update + 1)
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
        c.update, c.skipped_updates = c.update + int(applied), c.skipped_updates + int(not applied)
        c.bad_updates = 0 if health.finite else c.bad_updates + 1
        c.micro_batches, c.oom_micro_batches = c.micro_batches + planned, c.oom_micro_batches + health.oom_micro_batches
        guard.report(self.log, number, health, c, cfg, self.scaler)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        guard.check_nonfinite(cfg, c, health, scale, lambda: guard.locate_nonfinite(self.model, ctx),
                              self.saved_update)
        guard.check_out_of_memory(cfg, c, self.saved_update)
        self.optimizer.zero_grad(set_to_none=True)
        self.interval.add(totals[:5] if applied else None, float(norm), lr, health)
        c.stop_requested = c.stop_requested or totals[9] > 0
        self.save_due = totals[8] > 0
        return applied

    def batch(self, ids: np.ndarray) -> dict[str, Tensor]:
        arrays = collate(self.data.train.src, self.data.train.tgt, ids)
        return {k: torch.from_numpy(v).to(self.ctx.device, non_blocking=True) for k, v in arrays.items() if k != "ids"}

    def _time_flags(self) -> list[float]:
        """[save due by the clock, out of time] (summed over ranks, so all ranks decide alike); also
        brings the training time up to date."""
        now, cfg = time.monotonic(), self.cfg
        self.counters.train_seconds = now - self.run_start
        save = cfg.checkpoint.save_interval_minutes > 0 and now - self.last_save >= cfg.checkpoint.save_interval_minutes * 60
        stop = cfg.stop.max_time_hours > 0 and self.counters.train_seconds >= cfg.stop.max_time_hours * 3600
        return [float(save), float(stop)]

    def note_examples(self, ids: np.ndarray) -> None:
        if self.example_log:
            with open(Path(self.example_log) / f"examples.rank{self.ctx.rank}.txt", "a") as f:
                f.write(f"{self.counters.epoch} {self.counters.update} {' '.join(map(str, ids.tolist()))}\n")

    def _after_update(self, applied: bool) -> None:
        cfg, c = self.cfg, self.counters
        if applied:
            self.log.step(c.update, self.interval.last_loss, self.interval.last_lr, self.interval.speed())
            if cfg.log.interval > 0 and c.update % cfg.log.interval == 0 and self.interval.updates:
                self.log.record(self.interval.record(c))
                self.interval.reset()
        by_updates = applied and cfg.checkpoint.save_interval_updates > 0 and c.update % cfg.checkpoint.save_interval_updates == 0
        if by_updates or self.save_due:
            self._save()
        elif applied and cfg.valid.interval_updates > 0 and c.update % cfg.valid.interval_updates == 0:
            self._validate()

    # -- validation and checkpoints ----------------------------------------------------------------

    @torch.no_grad()
    def _validate(self) -> bool:
        """Loss and perplexity on the valid split (each rank takes a share of its batches), and BLEU
        when asked for; True when this is the best model so far by `best_metric`."""
        split, ctx, c = self.data.valid, self.ctx, self.counters
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)
        for ids in split.batches[ctx.rank :: ctx.world_size]:
            arrays = collate(split.src, split.tgt, ids)
            batch = {k: torch.from_numpy(v).to(ctx.device) for k, v in arrays.items() if k != "ids"}
            with self.autocast():
                loss, nll = micro_batch_loss(self.model, batch, self.cfg.optim.label_smoothing)
            sums += torch.stack([loss.double(), nll.double(), (batch["target"] != PAD).sum().double()])
        bleu = validation_bleu(self.model, self.data, self.cfg, ctx)
        self.model.train()
        loss_sum, nll_sum, tokens = distributed.all_reduce_sum(sums.tolist(), ctx)
        loss, nll = per_token(loss_sum, int(tokens)), per_token(nll_sum, int(tokens))
        if self.cfg.checkpoint.best_metric == "bleu":
            best = bleu is not None and (c.best_valid_bleu is None or bleu > c.best_valid_bleu)
        else:
            best = c.best_valid_loss is None or loss < c.best_valid_loss
        c.best_valid_loss = loss if c.best_valid_loss is None else min(loss, c.best_valid_loss)
        if bleu is not None:
            c.best_valid_bleu = bleu if c.best_valid_bleu is None else max(bleu, c.best_valid_bleu)
        c.valid_loss = loss
        self.log.record({"kind": "valid", "update": c.update, "epoch": c.epoch, "loss": round(loss, 6),
                         "nll": round(nll, 6), "ppl": round(math.exp(min(nll, 50.0)), 4), "tgt_tokens": int(tokens),
                         "best_loss": round(c.best_valid_loss, 6),
                         **({"bleu": bleu, "best_bleu": c.best_valid_bleu} if bleu is not None else {}),
                         "wall_seconds": round(c.train_seconds, 3)})
        return best

    def _save(self) -> None:
        c = self.counters
        if c.update == self.saved_update:
            return
        best = self._validate()
        guard.check_replicas(self.model, self.scaler.get_scale(), c.update, self.ctx)
        c.log_sums = self.interval.sums()
        rng = distributed.all_gather(rng_state(self.ctx.device), self.ctx)
        if self.ctx.is_main:
            state = training_checkpoint(self, rng, c.valid_loss, best)
            path = checkpoint.save_training(Path(self.cfg.save_dir), c.update, state, best, self.cfg.checkpoint.keep_last)
            self.log.info(f"saved {path}" + (" (best so far)" if best else ""))
        self.saved_update, self.last_save = c.update, time.monotonic()


def print_plan(cfg: TrainConfig) -> None:
    """--dry-run: what training would do on the devices asked for, without starting any; with
    try_largest_batch, whether the largest batch fits on one of them."""
    data = corpus.load(cfg)
    per_node = distributed.processes_per_node(cfg, planning=True)
    with torch.device("meta"):  # counts parameters without allocating them (transformer_big: 213M)
        params = sum(p.numel() for p in Transformer(cfg.model, len(data.dictionary)).parameters())
    kind = "GPU" if cfg.launch.gpus > 0 or (cfg.launch.nproc == 0 and distributed.use_cuda(cfg)) else "CPU process"
    print(corpus.describe_plan(cfg, data, per_node, kind, params, optim_lib.peak_learning_rate(cfg.optim, cfg.model.d_model)), flush=True)
    if cfg.try_largest_batch:
        if kind == "GPU" and not distributed.use_cuda(cfg):
            raise NmtError("try_largest_batch runs the largest batch on the GPU it plans for, and torch sees none "
                           "here: run the dry run on a machine of the kind that will train")
        ctx = distributed.Context(0, 1, 0, torch.device("cuda" if kind == "GPU" else "cpu"))
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        print(guard.try_largest_batch(Trainer(cfg, ctx, data, TrainLog(cfg.save_dir, enabled=False))))


def validation_bleu(model: Transformer, data: corpus.Corpus, cfg: TrainConfig,
                    ctx: distributed.Context) -> float | None:
    """sacreBLEU of the model's translations of the valid split (its first `valid_bleu_sentences`),
    searched with beam `valid_bleu_beam`, each rank translating a share. The references are the valid
    targets decoded from their pieces, so they carry sentencepiece's normalisation: a number to
    watch during training, close to but not the score `nmt score` gives against the raw text."""
    if not cfg.valid.bleu:
        return None
    import sacrebleu
    import sentencepiece as spm

    from nmt_cli.inference.search import translate_ids

    split, dictionary = data.valid, data.dictionary
    count = len(split.src) if cfg.valid.bleu_sentences <= 0 else min(cfg.valid.bleu_sentences, len(split.src))
    ids = [i for i in range(count) if split.src.sizes[i] < cfg.model.max_positions]  # + EOS must fit
    mine = ids[ctx.rank :: ctx.world_size]
    search = TranslateConfig(model=None, beam=cfg.valid.bleu_beam, nbest=1)
    found = translate_ids(model, [[*split.src[i].tolist(), EOS] for i in mine], search)
    sp = spm.SentencePieceProcessor(model_proto=data.spm_model)
    text = {i: sp.decode(dictionary.decode(h[0].tokens)) for i, h in zip(mine, found, strict=True)}
    for share in distributed.all_gather(text, ctx):
        text.update(share)
    references = [sp.decode(dictionary.decode(split.tgt[i].tolist())) for i in ids]
    return round(sacrebleu.corpus_bleu([text[i] for i in ids], [references]).score, 4)


class _Interval:
    """Sums over the updates since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, sums: dict[str, float] | None = None) -> None:
        self.values = dict.fromkeys(("loss", "nll", "tgt", "src", "sentences", "gnorm", "updates", "skipped",
                                     "oom"), 0.0)
        self.values.update(sums or {})
        self.clock, self.clock_tgt, self.last_loss, self.last_lr = time.monotonic(), 0.0, 0.0, 0.0

    def add(self, totals: list[float] | None, gnorm: float, lr: float, health: guard.Health) -> None:
        """One update's sums over all ranks, or None for a skipped update."""
        self.values["oom"] += health.oom_micro_batches
        if totals is None:
            self.values["skipped"] += 1
            return
        for key, value in zip(("loss", "nll", "tgt", "src", "sentences"), totals, strict=True):
            self.values[key] += value
        self.values["gnorm"] += gnorm
        self.values["updates"] += 1
        self.clock_tgt += totals[2]
        self.last_loss, self.last_lr = per_token(totals[0], int(totals[2])), lr

    @property
    def updates(self) -> int:
        return int(self.values["updates"])

    def speed(self) -> float:
        return self.clock_tgt / max(time.monotonic() - self.clock, 1e-9)

    def sums(self) -> dict[str, float]:
        return dict(self.values)

    def record(self, c: Counters) -> dict[str, Any]:
        v, n = self.values, max(self.updates, 1)
        nll = per_token(v["nll"], int(v["tgt"]))
        return {"kind": "train", "update": c.update, "epoch": c.epoch, "loss": round(per_token(v["loss"], int(v["tgt"])), 6),
                "nll": round(nll, 6), "ppl": round(math.exp(min(nll, 50.0)), 4), "lr": self.last_lr,
                "gnorm": round(v["gnorm"] / n, 6), "src_tokens": round(v["src"] / n), "tgt_tokens": round(v["tgt"] / n),
                "sentences": round(v["sentences"] / n), "updates": self.updates,
                "skipped_updates": int(v["skipped"]), "oom_micro_batches": int(v["oom"]),
                "tokens_per_second": round(self.speed(), 1), "wall_seconds": round(c.train_seconds, 3)}


if __name__ == "__main__":  # what torchrun starts: the `nmt train` command with the same arguments
    from nmt_cli.cli import app

    try:
        app(["train", *sys.argv[1:]], prog_name="nmt")
        status = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what the interpreter would have printed
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    # A worker ends without the interpreter's shutdown: gloo's threads may still hold a finished
    # collective whose tensors point to Python objects, and releasing them while the interpreter
    # shuts down aborts the process ("terminate called without an active exception", 2 runs in 141 of
    # tests/test_train.py's validation BLEU run; see pytorch pull request 179291). Everything this
    # worker wrote is closed by now; only its output streams remain to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
