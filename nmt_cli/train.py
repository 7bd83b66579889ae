"""`nmt train`: the paper's training (section 5) on one process or torchrun workers, resumable exactly.

`run(cfg)` launches torchrun when several devices take part (see `distributed`), or trains here.
One update = M micro-batches on each of W ranks (corpus.py); its loss is the label-smoothed
cross-entropy summed over every real target token and divided by the update's target tokens
(loss.py); Adam with the paper's schedule (optim.py). Checkpoints hold everything needed to
continue bit for bit: rerunning the same command resumes from checkpoint_last.pt.

Run as ``python -m nmt_cli.train ARGS`` (what torchrun starts) it is the `nmt train` command.
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

from nmt_cli import checkpoint, corpus, distributed
from nmt_cli import optim as optim_lib
from nmt_cli.artifacts import atomic_write_text
from nmt_cli.config import dump_yaml
from nmt_cli.data import EOS, PAD, collate
from nmt_cli.errors import NmtError
from nmt_cli.loss import label_smoothed_nll, per_token
from nmt_cli.model import Transformer
from nmt_cli.resume import Counters, apply_resume, training_checkpoint
from nmt_cli.stages import TrainConfig, TranslateConfig
from nmt_cli.trainlog import JSONL, TrainLog, truncate_after


def run(cfg: TrainConfig) -> None:
    if cfg.best_metric == "bleu" and not cfg.valid_bleu:
        raise NmtError("best_metric=bleu needs validation BLEU: add --valid-bleu")
    if cfg.dry_run:
        return print_plan(cfg)
    if distributed.in_worker():
        return train(cfg)
    nproc = distributed.processes_per_node(cfg)
    if nproc > 1 or cfg.nnodes > 1:
        return distributed.launch(cfg, nproc)
    train(cfg)


def train(cfg: TrainConfig) -> None:
    """Train in this process (a torchrun worker, or the only process)."""
    ctx = distributed.setup(cfg)
    log = TrainLog(cfg.save_dir, ctx.is_main, cfg.tensorboard_dir)
    try:
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        trainer = Trainer(cfg, ctx, corpus.load(cfg), log)
        trainer.start()
        try:
            trainer.loop()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            raise NmtError(f"out of memory in a micro-batch of max_tokens={cfg.max_tokens} on {ctx.device}: lower "
                           "--max-tokens (tokens_per_update stays: more micro-batches per update) and rerun "
                           "the same command to resume from checkpoint_last.pt") from None
    except NmtError as e:
        if not ctx.is_main:  # rank 0 mostly meets the same problem: it reports, torchrun stops the rest
            time.sleep(5)
            print(f"error (rank {ctx.rank}): {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise
    finally:
        log.close()
    distributed.teardown(ctx)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """auto: bf16 where the device multiplies bf16 fast (a CUDA GPU with bf16, a CPU with
    AVX512-BF16 or AMX), else fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def micro_batch_loss(model: torch.nn.Module, batch: dict[str, Tensor], epsilon: float) -> tuple[Tensor, Tensor]:
    """(label-smoothed loss, nll) of one micro-batch, summed over its real target tokens."""
    keep = batch["target"] != PAD  # (B, T)
    logits = model(batch["src"], batch["prev"], keep)  # (N, V), only real target positions
    return label_smoothed_nll(logits, batch["target"][keep], epsilon)


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: distributed.Context, data: corpus.Corpus, log: TrainLog) -> None:
        self.cfg, self.ctx, self.data, self.log = cfg, ctx, data, log
        self.precision = resolve_precision(cfg, ctx.device)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = Transformer(cfg.model, len(data.dictionary)).to(ctx.device)
        self.ddp = distributed.wrap(self.model, ctx)
        self.optimizer = optim_lib.build_optimizer(self.model.parameters(), cfg)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.micro_batches = corpus.micro_batches_per_update(cfg, data.train, ctx.world_size)
        self.counters = Counters()
        self.saved_update = -1
        self.interval = _Interval()
        self.save_due = False
        self.run_start = self.last_save = time.monotonic()
        torch.manual_seed(cfg.seed * 1000 + ctx.rank)  # dropout differs between ranks
        self.example_log = os.environ.get("NMT_TEST_EXAMPLE_LOG")  # tests: which examples each rank saw

    def autocast(self) -> Any:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=dtype)

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
                log.warn(f"{problem}; trying an older checkpoint")
            for note in apply_resume(self, state):
                log.warn(note)
            self.saved_update = self.counters.update
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
                              f"{min(cfg.model.max_positions, cfg.max_tokens)} tokens (max_positions, max_tokens)")
        self.log.info(f"parameters={sum(p.numel() for p in self.model.parameters())} devices={self.ctx.world_size} "
                      f"device={self.ctx.device.type} precision={self.precision} max_tokens={cfg.max_tokens} "
                      f"micro_batches_per_update={self.micro_batches} batches_per_epoch={len(split.batches)}")

    # -- the loop ---------------------------------------------------------------------------------

    def loop(self) -> None:
        cfg, c = self.cfg, self.counters
        if self._finished():
            self.log.info(f"already trained to update {c.update}, epoch {c.epoch}; nothing to do "
                          "(raise --max-update / --max-epoch to train on)")
            return
        self.log.start(c.update, cfg.max_update or None)
        self.run_start, self.last_save = time.monotonic() - c.train_seconds, time.monotonic()
        self.interval.reset(c.log_sums)
        while not self._finished():
            if not self._epoch():
                break
        self._save()

    def _finished(self) -> bool:
        c, cfg = self.counters, self.cfg
        out_of_time = cfg.max_time_hours > 0 and c.train_seconds >= cfg.max_time_hours * 3600
        return bool((cfg.max_update and c.update >= cfg.max_update) or (cfg.max_epoch and c.epoch > cfg.max_epoch)
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
            self.update(micro, tgt_tokens)
            c.epoch_batches_done = positions.stop
            self._after_update()
            if self._finished():
                return False
        c.epoch, c.epoch_batches_done = c.epoch + 1, 0
        return True

    def update(self, micro: list[np.ndarray | None], update_tgt_tokens: int) -> None:
        """Forward/backward of this rank's micro-batches, then one optimiser step."""
        cfg, c = self.cfg, self.counters
        sums = torch.zeros(5, dtype=torch.float64, device=self.ctx.device)  # loss, nll, tgt, src, sentences
        for i, ids in enumerate(micro):
            batch = self._batch(ids if ids is not None else self.data.train.batches[0])
            # dividing by the update's target tokens (all ranks) times W undoes DDP's mean over ranks
            weight = 0.0 if ids is None else self.ctx.world_size / update_tgt_tokens
            with distributed.gradient_sync(self.ddp, sync=i == len(micro) - 1):
                with self.autocast():  # the forward only, as torch.amp recommends
                    loss, nll = micro_batch_loss(self.ddp, batch, cfg.label_smoothing)
                self.scaler.scale(loss * weight).backward()
            if ids is not None:
                real = batch["target"] != PAD
                sums += torch.stack([loss.detach().double(), nll.double(), real.sum().double(),
                                     (batch["src"] != PAD).sum().double(), torch.tensor(len(ids), device=sums.device)])
                self._note_examples(ids)
        self.scaler.unscale_(self.optimizer)
        gnorm = self._gradient_norm()
        lr = optim_lib.learning_rate(cfg, c.update + 1)
        finite = math.isfinite(gnorm)
        if finite:
            optim_lib.set_learning_rate(self.optimizer, lr)
            self.scaler.step(self.optimizer)
            c.update, c.bad_updates = c.update + 1, 0
        else:
            c.bad_updates += 1
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_health(finite)
        totals = distributed.all_reduce_sum([*sums.tolist(), *self._time_flags()], self.ctx)
        self.interval.add(totals[:5], gnorm if finite else 0.0, lr)
        c.stop_requested = c.stop_requested or totals[6] > 0
        self.save_due = totals[5] > 0

    def _batch(self, ids: np.ndarray) -> dict[str, Tensor]:
        arrays = collate(self.data.train.src, self.data.train.tgt, ids)
        return {k: torch.from_numpy(v).to(self.ctx.device, non_blocking=True) for k, v in arrays.items() if k != "ids"}

    def _gradient_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.cfg.clip_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm))
        return float(torch.nn.utils.get_total_norm(grads))

    def _check_health(self, finite: bool) -> None:
        cfg = self.cfg
        if self.precision == "fp16":
            if self.scaler.get_scale() < cfg.min_loss_scale:
                raise NmtError(f"the fp16 loss scale fell below {cfg.min_loss_scale}: the gradients overflow "
                               "again and again. Train with --precision bf16 or fp32, or lower the learning rate")
        elif self.counters.bad_updates > cfg.max_bad_updates:
            raise NmtError(f"{self.counters.bad_updates} updates in a row had non-finite gradients and were "
                           "skipped; lower the learning rate (or raise warmup_updates) and rerun to resume "
                           f"from {cfg.save_dir}/checkpoint_last.pt")

    def _time_flags(self) -> list[float]:
        """[save due by the clock, out of time] (summed over ranks, so all ranks decide alike); also
        brings the training time up to date."""
        now, cfg = time.monotonic(), self.cfg
        self.counters.train_seconds = now - self.run_start
        save = cfg.save_interval_minutes > 0 and now - self.last_save >= cfg.save_interval_minutes * 60
        stop = cfg.max_time_hours > 0 and self.counters.train_seconds >= cfg.max_time_hours * 3600
        return [float(save), float(stop)]

    def _note_examples(self, ids: np.ndarray) -> None:
        if self.example_log:
            with open(Path(self.example_log) / f"examples.rank{self.ctx.rank}.txt", "a") as f:
                f.write(f"{self.counters.epoch} {self.counters.update} {' '.join(map(str, ids.tolist()))}\n")

    def _after_update(self) -> None:
        cfg, c = self.cfg, self.counters
        self.log.step(c.update, self.interval.last_loss, self.interval.last_lr, self.interval.speed())
        if cfg.log_interval > 0 and c.update % cfg.log_interval == 0 and self.interval.updates:
            self.log.record(self.interval.record(c))
            self.interval.reset()
        by_updates = cfg.save_interval_updates > 0 and c.update % cfg.save_interval_updates == 0
        if by_updates or self.save_due:
            self._save()
        elif cfg.validate_interval_updates > 0 and c.update % cfg.validate_interval_updates == 0:
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
                loss, nll = micro_batch_loss(self.model, batch, self.cfg.label_smoothing)
            sums += torch.stack([loss.double(), nll.double(), (batch["target"] != PAD).sum().double()])
        bleu = validation_bleu(self.model, self.data, self.cfg, ctx)
        self.model.train()
        loss_sum, nll_sum, tokens = distributed.all_reduce_sum(sums.tolist(), ctx)
        loss, nll = per_token(loss_sum, int(tokens)), per_token(nll_sum, int(tokens))
        if self.cfg.best_metric == "bleu":
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
        c.log_sums = self.interval.sums()
        rng = distributed.all_gather(_rng_state(self.ctx.device), self.ctx)
        if self.ctx.is_main:
            state = training_checkpoint(self, rng, c.valid_loss)
            path = checkpoint.save_training(Path(self.cfg.save_dir), c.update, state, best, self.cfg.keep_last)
            self.log.info(f"saved {path}" + (" (best so far)" if best else ""))
        self.saved_update, self.last_save = c.update, time.monotonic()


def print_plan(cfg: TrainConfig) -> None:
    """--dry-run: what training would do on the devices asked for, without starting any."""
    data = corpus.load(cfg)
    per_node = distributed.processes_per_node(cfg, planning=True)
    with torch.device("meta"):  # counts parameters without allocating them (transformer_big: 213M)
        params = sum(p.numel() for p in Transformer(cfg.model, len(data.dictionary)).parameters())
    kind = "GPU" if cfg.gpus > 0 or (cfg.nproc == 0 and distributed.use_cuda(cfg)) else "CPU process"
    print(corpus.describe_plan(cfg, data, per_node, kind, params, optim_lib.peak_learning_rate(cfg)))


def validation_bleu(model: Transformer, data: corpus.Corpus, cfg: TrainConfig,
                    ctx: distributed.Context) -> float | None:
    """sacreBLEU of the model's translations of the valid split (its first `valid_bleu_sentences`),
    searched with beam `valid_bleu_beam`, each rank translating a share. The references are the valid
    targets decoded from their pieces, so they carry sentencepiece's normalisation: a number to
    watch during training, close to but not the score `nmt score` gives against the raw text."""
    if not cfg.valid_bleu:
        return None
    import sacrebleu
    import sentencepiece as spm

    from nmt_cli.search import translate_ids

    split, dictionary = data.valid, data.dictionary
    count = len(split.src) if cfg.valid_bleu_sentences <= 0 else min(cfg.valid_bleu_sentences, len(split.src))
    ids = [i for i in range(count) if split.src.sizes[i] < cfg.model.max_positions]  # + EOS must fit
    mine = ids[ctx.rank :: ctx.world_size]
    search = TranslateConfig(model=None, beam=cfg.valid_bleu_beam, nbest=1)
    found = translate_ids(model, [[*split.src[i].tolist(), EOS] for i in mine], search)
    sp = spm.SentencePieceProcessor(model_proto=data.spm_model)
    text = {i: sp.decode(dictionary.decode(h[0].tokens)) for i, h in zip(mine, found, strict=True)}
    for share in distributed.all_gather(text, ctx):
        text.update(share)
    references = [sp.decode(dictionary.decode(split.tgt[i].tolist())) for i in ids]
    return round(sacrebleu.corpus_bleu([text[i] for i in ids], [references]).score, 4)


def _rng_state(device: torch.device) -> dict[str, Tensor | None]:
    """This rank's random-number state (dropout). Batch order needs none: it is drawn from (seed, epoch)."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


class _Interval:
    """Sums over the updates since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, sums: dict[str, float] | None = None) -> None:
        self.values = dict.fromkeys(("loss", "nll", "tgt", "src", "sentences", "gnorm", "updates"), 0.0)
        self.values.update(sums or {})
        self.clock, self.clock_tgt, self.last_loss, self.last_lr = time.monotonic(), 0.0, 0.0, 0.0

    def add(self, totals: list[float], gnorm: float, lr: float) -> None:
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
                "tokens_per_second": round(self.speed(), 1), "wall_seconds": round(c.train_seconds, 3)}


if __name__ == "__main__":  # what torchrun starts: the `nmt train` command with the same arguments
    from nmt_cli.cli import app

    app(["train", *sys.argv[1:]], prog_name="nmt")
