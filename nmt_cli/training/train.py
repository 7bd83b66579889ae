"""`nmt train`: the paper's training (section 5) on one process or torchrun workers, resumable exactly.

`run(cfg)` launches torchrun when several devices take part (see `distributed`; each worker runs
`nmt_cli.worker`), or trains here. The `Trainer` runs the epochs: each update is a `step.Step`
(micro-batches, gradients, the optimiser); between updates it logs, validates and saves. Checkpoints
hold everything needed to continue bit for bit: rerunning the same command resumes from the newest
intact checkpoint (checkpoint.py, resume.py). Non-finite values and micro-batches that run out of
memory are skipped alike on every rank, within limits (guard.py).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nmt_cli import hooks
from nmt_cli.artifacts import atomic_write_text
from nmt_cli.config.core import dump_yaml
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.train import TrainConfig
from nmt_cli.data.dataset import EOS, PAD, collate
from nmt_cli.errors import NmtError
from nmt_cli.model.cpu import Cpu, slow_bf16_warning
from nmt_cli.model.transformer import Transformer, build_model, count_parameters
from nmt_cli.training import checkpoint, corpus, distributed, finetune, flops, guard
from nmt_cli.training import optim as optim_lib
from nmt_cli.training.counters import Counters
from nmt_cli.training.loss import per_token
from nmt_cli.training.resume import apply_resume, rng_state, training_checkpoint
from nmt_cli.training.step import Outcome, Step, Totals, compiled_graphs, micro_batch_loss
from nmt_cli.training.trainlog import JSONL, Interval, TrainLog, truncate_after


def run(cfg: TrainConfig) -> None:
    cfg = finetune.with_init_model(cfg)
    if cfg.checkpoint.best_metric == "bleu" and not cfg.valid.bleu:
        raise NmtError("checkpoint.best_metric=bleu needs validation BLEU: add --valid-bleu")
    if cfg.try_largest_batch and not cfg.dry_run:
        raise NmtError("try_largest_batch is a part of the dry run: add --dry-run")
    if cfg.dry_run:
        return print_plan(cfg)
    if distributed.in_worker():
        return train(cfg)
    warn_if_slow_bf16(cfg)
    nproc = distributed.processes_per_node(cfg)
    if nproc > 1 or cfg.launch.nnodes > 1:
        return distributed.launch(cfg, nproc)
    train(cfg)


def warn_if_slow_bf16(cfg: TrainConfig, cpu: Cpu | None = None) -> None:
    """Say so before any work when bf16 was asked for on a CPU that runs it slowly (`cpu`: this one)."""
    if cfg.precision == "bf16" and not distributed.use_cuda(cfg):
        message = slow_bf16_warning("--precision bf16", "--precision auto", cpu)
        if message is not None:
            print(f"warning: {message}", file=sys.stderr, flush=True)


def train(cfg: TrainConfig) -> None:
    """Train in this process (a torchrun worker, or the only process)."""
    ctx = distributed.setup(cfg)
    hooks.at("worker_started", rank=ctx.rank)
    log = TrainLog(cfg.save_dir, ctx.is_main, cfg.log.tensorboard_dir)
    try:
        with guard.worker_errors(cfg, ctx):
            if cfg.threads > 0:
                torch.set_num_threads(cfg.threads)
            trainer = Trainer(cfg, ctx, corpus.load(cfg, ctx.world_size), log)
            with trainer.saver:  # the checkpoint being written is finished on every way out
                trainer.start()
                trainer.loop()
    finally:
        log.close()
    distributed.teardown(ctx)


class Trainer:
    """One rank's training run: its epochs of updates, the log, validation and checkpoints."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.Context, data: corpus.Corpus,
                 log: TrainLog) -> None:
        self.cfg, self.ctx, self.data, self.log = cfg, ctx, data, log
        self.step = Step(cfg, ctx, data)
        self.model = self.step.model
        self.counters = Counters()
        self.saved_update, self.saved_numbered = -1, False
        self.saver = checkpoint.Saver(log.info, log.warn)
        self.peak, self.peak_source = flops.device_peak(ctx.device, self.step.precision)
        vocab = len(data.dictionary)
        self.interval = Interval(lambda src, tgt, n: flops.training_flops(cfg.model, vocab, src, tgt, n),
                                  self.peak * ctx.world_size)
        self.save_due = False
        self.pending: list[tuple[Outcome, int]] = []  # updates run but not yet read from the device
        # graphs of torch.compile, as last logged (torch._dynamo only imported for a compiled run)
        self.graphs = compiled_graphs() if cfg.compile else 0
        self.run_start = self.last_save = time.monotonic()
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)  # dropout differs between ranks

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
        if found is None and cfg.init is not None:
            finetune.load_init_weights(self.step.model, cfg, self.data)
            log.info(f"starting from the weights of {cfg.init}")
        if found is not None:
            path, state, problems = found
            for problem in problems:
                log.warn(f"{problem}; skipped it")
            try:
                notes = apply_resume(self.step, self.counters, self.data, state)
            except (KeyError, TypeError, ValueError, IndexError) as e:
                # a valid checksum over an unknown layout
                raise NmtError(f"{path} has a training state this nmt cannot resume from "
                               f"({type(e).__name__}: {e}); "
                               "was it written by another nmt version? Use another --save-dir, or move the "
                               "checkpoints away to start afresh") from None
            for note in notes:
                log.warn(note)
            self.saved_update = self.counters.update
            if self.ctx.is_main and path.name != checkpoint.LAST:
                checkpoint.link_last(path)
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
                              f"{min(cfg.model.max_positions, cfg.batch.max_tokens)} tokens "
                              "(max_positions, max_tokens)")
        self.log.info(f"parameters={sum(p.numel() for p in self.model.parameters())} "
                      f"devices={self.ctx.world_size} device={self.ctx.device.type} "
                      f"precision={self.step.precision} batch.max_tokens={cfg.batch.max_tokens} "
                      f"micro_batches_per_update={self.step.micro_batches} "
                      f"batches_per_epoch={len(split.batches)} "
                      f"peak_tflops_per_device={self.peak / 1e12:.4g} ({self.peak_source})")

    # -- the loop ---------------------------------------------------------------------------------

    def loop(self) -> None:
        cfg, c = self.cfg, self.counters
        if self._finished(clock=True):
            self.log.info(f"already trained to update {c.update}, epoch {c.epoch}; nothing to do "
                          "(raise --max-update / --max-epoch to train on)")
            return
        self.log.start(c.update, cfg.stop.max_update or None)
        self.run_start, self.last_save = time.monotonic() - c.train_seconds, time.monotonic()
        self.interval.reset(c.log_sums)
        while not self._finished():
            if not self._epoch():
                break
        self._settle()
        self._save(numbered=self._numbered_at_end())

    def _finished(self, clock: bool = False) -> bool:
        """Whether a stop condition holds. The clock is read here only with `clock` (before the first
        update); during the run the ranks learn it together, from the flags of `_time_flags`."""
        c, cfg = self.counters, self.cfg
        limit = cfg.stop.max_time_hours * 3600
        out_of_time = clock and limit > 0 and c.train_seconds >= limit
        return bool((cfg.stop.max_update and c.update >= cfg.stop.max_update)
                    or (cfg.stop.max_epoch and c.epoch > cfg.stop.max_epoch)
                    or c.stop_requested or out_of_time)

    def _epoch(self) -> bool:
        """Train on the rest of the current epoch; False when a stop condition ended it early."""
        c, split, W, M = self.counters, self.data.train, self.ctx.world_size, self.step.micro_batches
        order = corpus.order_of(split, c.epoch, self.cfg.seed)
        start = c.epoch_batches_done

        def batches(u: int) -> tuple[range, list[np.ndarray | None]]:
            positions = corpus.update_positions(start, u, W, M, len(split.batches))
            return positions, corpus.rank_micro_batches(split, order, positions, self.ctx.rank, W, M)

        count = corpus.updates_per_epoch(len(split.batches), W, M, start)
        upcoming = batches(0) if count else None
        for u in range(count):
            positions, micro = upcoming
            upcoming = batches(u + 1) if u + 1 < count else None
            _, tgt_tokens = corpus.update_tokens(split, order, positions)
            applied = self.update(micro, tgt_tokens, len(positions), upcoming[1][0] if upcoming else None)
            c.epoch_batches_done = positions.stop
            self._after_update(applied)
            if self._finished():
                return False
        c.epoch, c.epoch_batches_done = c.epoch + 1, 0
        return True

    def update(self, micro: list[np.ndarray | None], update_tgt_tokens: int, planned: int,
               upcoming: np.ndarray | None = None) -> bool | None:
        """One `Step` of this rank's micro-batches. Its outcome stays on the device, the update counted
        as applied, until a sync point (`_sync_due`: log lines, saves, validation, the last update);
        there `_settle` reads every update since the last at once, and counts, logs and checks each
        alike on every rank. Returns whether this update was applied when it was settled here, else None."""
        c = self.counters
        attempt, number = c.update + c.skipped_updates + 1, c.update + 1
        out = self.step.run(micro, update_tgt_tokens, attempt, number, self._time_flags(), upcoming)
        for ids in out.trained:
            hooks.at("examples_trained", rank=self.ctx.rank, epoch=c.epoch, update=c.update, ids=ids.tolist())
        c.update += 1
        self.pending.append((out, planned))
        applied = self._settle() if self._sync_due() else None
        self.step.zero_grad()
        return applied

    def _sync_due(self) -> bool:
        """Whether the host reads the device's account now: on every cadence of the update number
        (counted as if every update since the last sync applied, so a skip only brings a sync early,
        never past a cadence), at the last update, every `log.interval` updates at most (100 with no
        log), and after each fp16 update (its loss scale is the host's)."""
        cfg, n = self.cfg, self.counters.update
        cadences = (cfg.log.interval, cfg.checkpoint.save_interval_updates, cfg.valid.interval_updates)
        return bool(self.step.scaler.is_enabled() or len(self.pending) >= (cfg.log.interval or 100)
                    or any(k > 0 and n % k == 0 for k in cadences)
                    or (cfg.stop.max_update and n >= cfg.stop.max_update))

    def _settle(self) -> bool | None:
        """Read the outcomes of the updates since the last sync (one wait for the device) and take
        each in turn as it happened: the counters, the warnings and limits of `guard`, the log.
        Returns whether the last one was applied (None when there was none)."""
        if not self.pending:
            return None
        cfg, c, scaler = self.cfg, self.counters, self.step.scaler
        pending, self.pending = self.pending, []
        rows = torch.stack([torch.cat([out.totals, out.norm.double()[None]]) for out, _ in pending]).tolist()
        c.update -= len(pending)
        applied = False
        for (out, planned), row in zip(pending, rows, strict=True):
            totals, norm, number = Totals.read(row[:-1]), row[-1], c.update + 1
            health = guard.Health(int(totals.loss_bad_ranks), int(totals.grad_bad_ranks),
                                  int(totals.oom_micro_batches), self.ctx.world_size)
            applied = totals.applied
            c.update, c.skipped_updates = c.update + int(applied), c.skipped_updates + int(not applied)
            c.bad_updates = 0 if health.finite else c.bad_updates + 1
            c.micro_batches, c.oom_micro_batches = (c.micro_batches + planned,
                                                    c.oom_micro_batches + health.oom_micro_batches)
            guard.report(self.log, number, health, c, cfg, scaler)
            scale = scaler.get_scale() if scaler.is_enabled() else None
            guard.check_nonfinite(cfg, c, health, scale, lambda: guard.locate_nonfinite(
                self.model, self.ctx, self.step.nonfinite_gradients()), self.saved_update)
            guard.check_out_of_memory(cfg, c, self.saved_update)
            self.interval.add(totals.trained if applied else None, norm, out.lr, health.oom_micro_batches)
            save, stop = totals.flags  # as `_time_flags` made them
            c.stop_requested = c.stop_requested or stop > 0
            self.save_due = self.save_due or save > 0
            every = cfg.log.interval
            if applied and every > 0 and c.update % every == 0 and self.interval.updates:
                self.log.record(self.interval.record(c))
                self.interval.reset()
        if cfg.compile and (graphs := compiled_graphs()) != self.graphs:
            self.log.info(f"torch.compile made {graphs - self.graphs} graph(s) of the model for new batch "
                          f"shapes ({graphs} so far)")
            self.graphs = graphs
        return applied

    def _time_flags(self) -> list[float]:
        """[save due by the clock, out of time] (summed over ranks, so all ranks decide alike); also
        brings the training time up to date."""
        now, cfg = time.monotonic(), self.cfg
        self.counters.train_seconds = now - self.run_start
        save = (cfg.checkpoint.save_interval_minutes > 0
                and now - self.last_save >= cfg.checkpoint.save_interval_minutes * 60)
        stop = cfg.stop.max_time_hours > 0 and self.counters.train_seconds >= cfg.stop.max_time_hours * 3600
        return [float(save), float(stop)]

    def _after_update(self, applied: bool | None) -> None:
        """The progress bar; once the update is settled (`applied` not None), the saves and validation
        it is due for."""
        cfg, c = self.cfg, self.counters
        self.log.step(c.update, self.interval.last_loss, self.interval.last_lr, self.interval.speed())
        if applied is None:  # every cadence is a sync point: none is due
            return
        by_updates = (applied and cfg.checkpoint.save_interval_updates > 0
                      and c.update % cfg.checkpoint.save_interval_updates == 0)
        if by_updates or self.save_due:
            # the clock's saves are numbered only when no update cadence is set (never both kinds in an
            # average), or at the end of training (written once, numbered)
            self._save(numbered=by_updates or (self._numbered_at_end() if self._finished() else
                                               cfg.checkpoint.save_interval_updates == 0))
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
        batches = split.batches[: self.cfg.valid.max_batches or None]
        for ids in batches[ctx.rank :: ctx.world_size]:
            arrays = collate(split.src, split.tgt, ids)
            batch = {k: torch.from_numpy(v).to(ctx.device) for k, v in arrays.items() if k != "ids"}
            with self.step.autocast():
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
                         "nll": round(nll, 6), "ppl": round(math.exp(min(nll, 50.0)), 4),
                         "tgt_tokens": int(tokens), "best_loss": round(c.best_valid_loss, 6),
                         **({"bleu": bleu, "best_bleu": c.best_valid_bleu} if bleu is not None else {}),
                         "wall_seconds": round(c.train_seconds, 3)})
        return best

    def _numbered_at_end(self) -> bool:
        """The last save of a run is numbered when training reached its update or epoch limit (the
        end of the paper's schedule, averaged with the checkpoints before it) or the clock sets the
        cadence; a run stopped by the time limit or by hand continues later on the cadence."""
        c, cfg = self.counters, self.cfg
        done = bool((cfg.stop.max_update and c.update >= cfg.stop.max_update)
                    or (cfg.stop.max_epoch and c.epoch > cfg.stop.max_epoch))
        return done or cfg.checkpoint.save_interval_updates == 0

    def _save(self, numbered: bool = True) -> None:
        """Validate, then write a checkpoint: numbered (the averaging cadence) or checkpoint_last.pt
        alone (crash safety). Rank 0 copies the state and writes it in the background (`Saver`)."""
        self._settle()
        c, self.save_due = self.counters, False
        if c.update == self.saved_update and (self.saved_numbered or not numbered):
            return
        best = self._validate()
        guard.check_replicas(self.model, self.step.scaler.get_scale(), c.update, self.ctx)
        c.log_sums = self.interval.sums()
        rng = distributed.all_gather(rng_state(self.ctx.device), self.ctx)
        if self.ctx.is_main:
            state = training_checkpoint(self.step, c, self.data, rng, best)
            self.saver.submit(Path(self.cfg.save_dir), c.update, state, best, self.cfg.checkpoint.keep_last,
                              numbered)
        self.saved_update, self.saved_numbered, self.last_save = c.update, numbered, time.monotonic()


def print_plan(cfg: TrainConfig) -> None:
    """--dry-run: what training would do on the devices asked for, without starting any; with
    try_largest_batch, whether the largest batch fits on one of them."""
    per_node = distributed.processes_per_node(cfg, planning=True)
    data = corpus.load(cfg, per_node * cfg.launch.nnodes)
    with torch.device("meta"):  # counts parameters without allocating them (transformer_big: 213M)
        params = count_parameters(build_model(cfg.model, data.dictionary))
    kind = ("GPU" if cfg.launch.gpus > 0 or (cfg.launch.nproc == 0 and distributed.use_cuda(cfg))
            else "CPU process")
    print(corpus.describe_plan(cfg, data, per_node, kind, params,
                               optim_lib.peak_learning_rate(cfg.optim, cfg.model.d_model)), flush=True)
    if cfg.try_largest_batch:
        if kind == "GPU" and not distributed.use_cuda(cfg):
            raise NmtError("try_largest_batch runs the largest batch on the GPU it plans for, and torch sees "
                           "none here: run the dry run on a machine of the kind that will train")
        ctx = distributed.Context(0, 1, 0, torch.device("cuda" if kind == "GPU" else "cpu"))
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        print(Step(cfg, ctx, data).try_largest_batch())


def validation_bleu(model: Transformer, data: corpus.Corpus, cfg: TrainConfig,
                    ctx: distributed.Context) -> float | None:
    """sacreBLEU of the model's translations of the valid split (its first `valid.bleu_sentences`),
    searched with beam `valid.bleu_beam`, each rank translating a share. The references are the valid
    targets decoded from their pieces, so they carry sentencepiece's normalisation: a number to
    watch during training, close to but not the score `nmt score` gives against the raw text. The
    sources were normalised by `nmt bpe` as `nmt translate` normalises its input by default."""
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
    sp = spm.SentencePieceProcessor(model_proto=data.target_spm)  # hypotheses and references: the target
    text = {i: sp.decode(dictionary.decode(h[0].tokens)) for i, h in zip(mine, found, strict=True)}
    for share in distributed.all_gather(text, ctx):
        text.update(share)
    references = [sp.decode(dictionary.decode(split.tgt[i].tolist())) for i in ids]
    return round(sacrebleu.corpus_bleu([text[i] for i in ids], [references]).score, 4)
