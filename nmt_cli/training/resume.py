"""What a training checkpoint holds beyond the model, and how a run continues from one.

Layout of a training checkpoint (see `model.file` for the file format and the model keys):

    "kind": "checkpoint", "model", "model_config", "dictionary", "spm_model",
    "meta":  {"nmt_version", "created", "arch", "src_lang", "tgt_lang", "update", "epoch", "valid_loss",
              "best": whether it was the best so far when saved},
    "train": {"config": the resolved TrainConfig as a mapping of its sections (flat in older checkpoints),
              "update", "epoch", "epoch_batches_done", "train_seconds", "best_valid_loss", "best_valid_bleu",
              "bad_updates", "skipped_updates", "oom_micro_batches", "micro_batches" (see guard.py),
              "world_size", "micro_batches_per_update", "batches_per_epoch", "precision",
              "optimizer": optimizer.state_dict(), "scaler": GradScaler.state_dict() ({} unless fp16),
              "lr": the rate of the last step (the schedule itself is a pure function of "update"),
              "rng": [{"torch": CPU generator state, "cuda": GPU generator state or None}, one per rank],
              "log_sums": the running sums of the log interval in progress}

Everything is tensors, numbers, strings and plain containers: it loads with weights_only=True.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
from torch import Tensor

from nmt_cli import __version__
from nmt_cli.config.core import flatten, to_dict
from nmt_cli.config.train import TrainConfig
from nmt_cli.errors import NmtError
from nmt_cli.model.file import differing_fields, model_config_of, model_description
from nmt_cli.training.corpus import Corpus
from nmt_cli.training.counters import Counters
from nmt_cli.training.step import Step

# Training settings whose change on resume is expected (where the data is, when to stop, how to report
# and launch); a section stands for all its fields. The model is compared on its own (`apply_resume`).
_FREE_TO_CHANGE = {"data", "save_dir", "threads", "compile", "dry_run", "try_largest_batch", "model",
                   "stop", "checkpoint", "valid", "log", "guard", "launch"}


def training_checkpoint(step: Step, c: Counters, data: Corpus, rng: list[dict[str, Any]],
                        best: bool) -> dict[str, Any]:
    """The whole state of a run (rank 0's `step`, where it stands, its data) as a checkpoint mapping;
    `rng` holds every rank's random-number state. The weights and optimiser moments are the run's own
    tensors, on its device: `checkpoint.Saver` copies them once, before training changes them."""
    cfg = step.cfg
    return {
        "kind": "checkpoint",
        **model_description(cfg.model, data.dictionary, data.spm_model, data.source_normalization),
        # the target side's own model, where the data has one (`nmt translate` decodes with it)
        **({} if data.target_spm_model is None else {"target_spm_model": data.target_spm_model}),
        "model": {k: v.detach() for k, v in step.model.state_dict().items()},
        "meta": {"nmt_version": __version__, "arch": cfg.arch,
                 "src_lang": data.src_lang, "tgt_lang": data.tgt_lang,
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "update": c.update, "epoch": c.epoch, "valid_loss": c.valid_loss, "best": best},
        "train": {
            "config": to_dict(cfg),
            "update": c.update, "epoch": c.epoch, "epoch_batches_done": c.epoch_batches_done,
            "train_seconds": c.train_seconds, "best_valid_loss": c.best_valid_loss,
            "best_valid_bleu": c.best_valid_bleu, "bad_updates": c.bad_updates,
            "skipped_updates": c.skipped_updates, "oom_micro_batches": c.oom_micro_batches,
            "micro_batches": c.micro_batches,
            "world_size": step.ctx.world_size, "micro_batches_per_update": step.micro_batches,
            "batches_per_epoch": len(data.train.batches),
            "precision": step.precision,
            "optimizer": step.optimizer.state_dict(),
            "scaler": step.scaler.state_dict() if step.scaler.is_enabled() else {},
            "lr": step.optimizer.param_groups[0]["lr"],
            "rng": rng,
            "log_sums": dict(c.log_sums),
        },
    }


def apply_resume(step: Step, c: Counters, data: Corpus, state: dict[str, Any]) -> list[str]:
    """Load `state` into `step` and `c`; returns warnings (continuing, but not bit for bit). Refuses
    a checkpoint of another model or dictionary."""
    cfg, train = step.cfg, state["train"]
    stored = dataclasses.asdict(model_config_of(state, cfg.save_dir))  # a field added since: its default
    differing = differing_fields(stored, dataclasses.asdict(cfg.model))
    if differing:
        raise NmtError(f"{cfg.save_dir} holds checkpoints of another model ({'; '.join(differing)}, "
                       "checkpoint vs now); use the same model settings to resume, or another --save-dir "
                       "for a new model")
    if list(state["dictionary"]["symbols"]) != data.dictionary.symbols:
        raise NmtError(f"the checkpoints in {cfg.save_dir} were trained with another dictionary than "
                       f"{cfg.data}/dict.txt; resume with the data they were trained on, "
                       "or use another --save-dir")
    step.model.load_state_dict(state["model"])
    step.optimizer.load_state_dict(train["optimizer"])
    if step.scaler.is_enabled() and train["scaler"]:
        step.scaler.load_state_dict(train["scaler"])
    c.update, c.epoch, c.epoch_batches_done = train["update"], train["epoch"], train["epoch_batches_done"]
    c.train_seconds, c.best_valid_loss, c.bad_updates = (train["train_seconds"], train["best_valid_loss"],
                                                         train["bad_updates"])
    c.best_valid_bleu = train.get("best_valid_bleu")
    for name in ("skipped_updates", "oom_micro_batches", "micro_batches"):  # absent before these were counted
        setattr(c, name, train.get(name, 0))
    c.log_sums = dict(train["log_sums"])
    return _restore_rng(step, train["rng"]) + _changed_settings(step, train) + _same_place(c, data, train)


def _same_place(c: Counters, data: Corpus, train: dict[str, Any]) -> list[str]:
    """Another number of devices may pack the batches under another budget (corpus.plan_train), and
    an nmt before d500be5 sorted them otherwise (`dataset.batch_by_size`): the epoch then goes on from
    the same share of its batches."""
    before, now = train.get("batches_per_epoch", len(data.train.batches)), len(data.train.batches)
    if before == now:
        return []
    c.epoch_batches_done = min(round(c.epoch_batches_done * now / before), now)
    return [f"the epoch now has {now} batches instead of {before} (another number of devices, or an older "
            f"nmt, packs them otherwise): it goes on from batch {c.epoch_batches_done}, the same share of it"]


def rng_state(device: torch.device) -> dict[str, Tensor | None]:
    """This rank's random-number state (dropout). Batch order needs none: it is drawn from (seed, epoch)."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _restore_rng(step: Step, states: list[dict[str, Any]]) -> list[str]:
    ctx = step.ctx
    if len(states) != ctx.world_size:
        return [f"the checkpoint was written by {len(states)} worker(s), now there are {ctx.world_size}: "
                "training continues, but not bit for bit as it would have (dropout and batch shares differ)"]
    mine = states[ctx.rank]
    torch.set_rng_state(mine["torch"])
    if ctx.device.type == "cuda" and mine["cuda"] is not None:
        torch.cuda.set_rng_state(mine["cuda"], ctx.device)
    return []


def stored_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's train config as dotted keys (``optim.lr``). A config written before TrainConfig had
    sections (flat: ``max_tokens``, ``valid_bleu``, ...) is read under its keys' new names."""
    return {TrainConfig.RENAMED.get(key, key): value for key, value in flatten(config).items()}


def _changed_settings(step: Step, train: dict[str, Any]) -> list[str]:
    now, before = flatten(to_dict(step.cfg)), stored_settings(train["config"])
    changed = [f for f in differing_fields(before, now)
               if f.split(":")[0].split(".")[0] not in _FREE_TO_CHANGE]
    notes = []
    if changed:
        notes.append("training settings changed since the checkpoint (" + "; ".join(changed) + "): "
                     "the run continues with the new ones")
    if train["micro_batches_per_update"] != step.micro_batches and train["world_size"] == step.ctx.world_size:
        notes.append(f"micro-batches per update changed from {train['micro_batches_per_update']} to "
                     f"{step.micro_batches}: training continues, but not bit for bit")
    if train["precision"] != step.precision:
        notes.append(f"precision changed from {train['precision']} to {step.precision}")
    return notes
