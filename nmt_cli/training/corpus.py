"""The training corpus of `nmt train` and its batch plan: which examples each micro-batch, update,
rank and epoch holds.

The plan is a pure function of the data, `max_tokens` and the seed, so every rank computes the
same plan without talking to the others, and a resumed run finds its place from two numbers: the
epoch and how many batches of that epoch are done.

- Batches: examples sorted by length and packed under `max_tokens` padded tokens (data.batch_by_size);
  examples too long for the model or for a micro-batch are left out, counted and reported.
- Epoch: the batches in an order drawn from (seed, epoch) (data.epoch_order).
- Update: the next W * M batches of that order (W ranks, M micro-batches each), dealt round-robin,
  so rank r's micro-batch i of the update is position start + i * W + r.
  M follows from `tokens_per_update`; where even one micro-batch per rank would overshoot it by more
  than `TOLERANCE` (many devices), the training batches are packed under a smaller budget than
  `max_tokens` so that W * M micro-batches hold `tokens_per_update` (`plan_train`). Every rank ends
  each update with one synchronised backward
  pass (the gradient all-reduce); a rank left without batches at the end of an epoch runs one
  zero-weight micro-batch of the shortest example for it (`shortest_example`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from nmt_cli.artifacts import manifest_languages, read_manifest
from nmt_cli.config.train import BatchConfig, TrainConfig
from nmt_cli.data.bpe import TARGET_SPM, sentencepiece_processor
from nmt_cli.data.clean import Normalization
from nmt_cli.data.dataset import Dictionary, IndexedDataset, batch_by_size, epoch_order, filter_by_size
from nmt_cli.errors import NmtError


@dataclasses.dataclass
class Split:
    """One split of the corpus and its batches (token counts exclude padding, include EOS)."""

    src: IndexedDataset
    tgt: IndexedDataset
    batches: list[np.ndarray]
    src_tokens: np.ndarray  # (number of batches,) real source tokens per batch
    tgt_tokens: np.ndarray  # (number of batches,) real target tokens per batch
    skipped: int  # examples left out for being too long
    max_tokens: int = 0  # the padded-token budget its batches were packed under


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How the training batches make updates on `world_size` ranks."""

    world_size: int
    micro_batches: int  # M, per rank per update
    max_tokens: int  # the budget of one micro-batch (batch.max_tokens, or less to hold tokens_per_update)
    tokens_per_update: float  # planned: W * M * the mean real target tokens of a batch

    def describe(self, batch: BatchConfig) -> str:
        share = self.tokens_per_update / batch.tokens_per_update - 1
        shrunk = (f"; micro-batch budget lowered from {batch.max_tokens:,} to {self.max_tokens:,} tokens "
                  "to hold it" if self.max_tokens < batch.max_tokens else "")
        return (f"tokens per update: {batch.tokens_per_update:,} asked; {self.tokens_per_update:,.0f} real "
                f"target tokens planned ({share:+.1%}: {self.world_size} devices x {self.micro_batches} x "
                f"{self.tokens_per_update / (self.world_size * self.micro_batches):,.0f}){shrunk}")


# How far the planned target tokens of an update may be from tokens_per_update before the planner
# packs smaller micro-batches.
TOLERANCE = 0.05


@dataclasses.dataclass
class Corpus:
    folder: Path
    src_lang: str
    tgt_lang: str
    dictionary: Dictionary
    spm_model: bytes
    train: Split
    valid: Split
    plan: UpdatePlan
    source_normalization: dict[str, Any] | None = None  # the record `nmt prepare` wrote; None: not said
    target_spm_model: bytes | None = None  # the target side's own model (`nmt bpe --target-model`)

    @property
    def target_spm(self) -> bytes:
        """The sentencepiece model of the target side: its own, or the one of both sides."""
        return self.spm_model if self.target_spm_model is None else self.target_spm_model


def load(cfg: TrainConfig, world_size: int = 1) -> Corpus:
    """Read the folder written by `nmt binarize` and plan the batches of train (for `world_size`
    ranks) and valid."""
    folder = Path(cfg.data)
    redo = f"nmt binarize BPE_FOLDER --out {folder}"
    manifest = read_manifest(folder, "binarize", redo)
    src_lang, tgt_lang = manifest_languages(manifest, folder)
    dictionary = Dictionary.load(folder / "dict.txt")
    if len(dictionary) != manifest.get("dict_size", len(dictionary)):
        raise NmtError(f"{folder}/dict.txt has {len(dictionary)} symbols but {folder}/manifest.json says "
                       f"{manifest['dict_size']}; run `nmt binarize` again")
    spm_path = folder / "spm.model"
    if not spm_path.is_file():
        raise NmtError(f"{spm_path} is missing; run `nmt binarize` again (it copies the sentencepiece model)")
    spm_model = spm_path.read_bytes()  # checked now: every checkpoint carries it, for `nmt translate`
    sentencepiece_processor(spm_model, str(spm_path), f"run `{redo}` again")
    target_path = folder / TARGET_SPM
    target_spm = target_path.read_bytes() if target_path.is_file() else None
    if target_spm is not None:
        sentencepiece_processor(target_spm, str(target_path), f"run `{redo}` again")
    splits = {}
    for split in ("train", "valid"):
        src, tgt = (IndexedDataset(folder / f"{split}.{src_lang}"),
                    IndexedDataset(folder / f"{split}.{tgt_lang}"))
        if len(src) != len(tgt):
            raise NmtError(f"{folder}/{split}.{src_lang} has {len(src)} sentences but {split}.{tgt_lang} has "
                           f"{len(tgt)}; run `nmt binarize` again")
        if len(src) == 0:
            raise NmtError(f"{folder}/{split}.{src_lang} holds no sentences; nothing to {split} on")
        for lang, data in ((src_lang, src), (tgt_lang, tgt)):
            _check_ids(data, len(dictionary), folder / f"{split}.{lang}.bin")
        splits[split] = plan_split(src, tgt, cfg.model.max_positions, cfg.batch.max_tokens)
    normalization = manifest.get("source_normalization")
    Normalization.from_record(normalization, f"{folder}/manifest.json", f"run `{redo}` again")
    train, plan = plan_train(splits["train"], cfg.batch, cfg.model.max_positions, world_size)
    return Corpus(folder, src_lang, tgt_lang, dictionary, spm_model, train, splits["valid"], plan,
                  normalization, target_spm)


def _check_ids(data: IndexedDataset, dict_size: int, path: Path) -> None:
    """Refuse token ids outside the dictionary: the embedding lookup would fail mid-training. One pass
    over the memory map (about a second per 10^9 tokens), in chunks so memory stays flat."""
    step = 1 << 26
    for start in range(0, len(data.tokens), step):
        if int(data.tokens[start : start + step].max()) >= dict_size:
            raise NmtError(f"{path} holds token ids beyond the {dict_size} symbols of dict.txt: "
                           "it does not belong to this dictionary or is damaged; run `nmt binarize` again")


def plan_split(src: IndexedDataset, tgt: IndexedDataset, max_positions: int, max_tokens: int,
               budget: int | None = None) -> Split:
    """Examples longer than `max_tokens` (or the model) left out, the rest packed under `budget`
    padded tokens (default `max_tokens`; an example longer than a smaller budget gets a batch alone)."""
    src_sizes, tgt_sizes = src.sizes.astype(np.int64) + 1, tgt.sizes.astype(np.int64) + 1  # + EOS
    kept, skipped = filter_by_size(src_sizes, tgt_sizes, max_positions, max_tokens)
    batches = batch_by_size(kept, src_sizes, tgt_sizes, budget or max_tokens)
    src_tokens = np.array([src_sizes[b].sum() for b in batches], np.int64)
    tgt_tokens = np.array([tgt_sizes[b].sum() for b in batches], np.int64)
    return Split(src, tgt, batches, src_tokens, tgt_tokens, len(skipped), budget or max_tokens)


def micro_batches_per_update(batch: BatchConfig, split: Split, world_size: int) -> int:
    """M, so that W ranks * M micro-batches hold about `tokens_per_update` real target tokens,
    estimated from the mean target tokens of the planned batches (or given as
    batch.micro_batches_per_update): the nearest M when it lands within TOLERANCE, else the
    smallest M that reaches it (`plan_train` then packs smaller micro-batches)."""
    if batch.micro_batches_per_update > 0:
        return batch.micro_batches_per_update
    mean = split.tgt_tokens.mean() if len(split.batches) else 1.0
    exact = batch.tokens_per_update / (world_size * mean)
    nearest = round(exact)
    wanted = nearest if nearest >= 1 and abs(nearest / exact - 1) <= TOLERANCE else math.ceil(exact)
    return min(wanted, math.ceil(len(split.batches) / world_size))  # an update never exceeds an epoch


def plan_train(split: Split, batch: BatchConfig, max_positions: int,
               world_size: int) -> tuple[Split, UpdatePlan]:
    """The training batches and M for `world_size` ranks. When W * M micro-batches of `max_tokens`
    would hold more than tokens_per_update (+ TOLERANCE), the batches are packed again under the
    budget whose mean real target tokens are tokens_per_update / (W * M): found by a few secant
    steps on the budget (each a pass of batch_by_size), inside a shrinking bracket."""
    M = micro_batches_per_update(batch, split, world_size)
    goal = batch.tokens_per_update / (world_size * M)
    best = split
    if len(split.batches) and split.tgt_tokens.mean() > goal * (1 + TOLERANCE):
        low, high, budget = 1, batch.max_tokens, batch.max_tokens * goal / split.tgt_tokens.mean()
        for _ in range(12):
            budget = int(min(max(budget, low + 1), high - 1))
            if not low < budget < high:
                break
            trial = plan_split(split.src, split.tgt, max_positions, batch.max_tokens, budget)
            mean = trial.tgt_tokens.mean()
            if abs(mean / goal - 1) < abs(best.tgt_tokens.mean() / goal - 1):
                best = trial
            if abs(mean / goal - 1) <= TOLERANCE / 3:
                break
            low, high = (low, budget) if mean > goal else (budget, high)
            budget = budget * goal / mean
    planned = world_size * M * float(best.tgt_tokens.mean()) if len(best.batches) else 0.0
    return best, UpdatePlan(world_size, M, best.max_tokens, planned)


def updates_per_epoch(n_batches: int, world_size: int, micro_batches: int, start: int = 0) -> int:
    """Updates left in an epoch whose first `start` batches are done."""
    return math.ceil(max(n_batches - start, 0) / (world_size * micro_batches))


def update_positions(start: int, update: int, world_size: int, micro_batches: int, n_batches: int) -> range:
    """Positions in the epoch order of all batches of update `update` (counted from `start`)."""
    first = start + update * world_size * micro_batches
    return range(first, min(first + world_size * micro_batches, n_batches))


def update_tokens(split: Split, order: np.ndarray, positions: range) -> tuple[int, int]:
    """(source, target) real tokens of one update over all ranks: known before it runs, so the
    loss can be normalised by the whole update's target tokens without communication."""
    ids = order[positions.start : positions.stop]
    return int(split.src_tokens[ids].sum()), int(split.tgt_tokens[ids].sum())


def rank_micro_batches(split: Split, order: np.ndarray, positions: range, rank: int,
                       world_size: int, micro_batches: int) -> list[np.ndarray | None]:
    """This rank's micro-batches (example ids) of an update, at most M; [None] (a zero-weight dummy)
    when the epoch has none left for it, so that its one synchronised backward pass still happens."""
    mine = [split.batches[order[p]] for p in positions[rank::world_size]]
    assert len(mine) <= micro_batches
    return mine or [None]


def shortest_example(split: Split) -> np.ndarray:
    """A one-example batch of the shortest planned example: what a rank trains at weight zero to take
    part in an update's gradient all-reduce when it has nothing else (an epoch's end, or a micro-batch
    that ran out of memory)."""
    ids = np.concatenate(split.batches)
    sizes = split.src.sizes[ids].astype(np.int64) + split.tgt.sizes[ids]
    return ids[[int(np.argmin(sizes))]]


def largest_batches(split: Split) -> list[np.ndarray]:
    """The batches most likely to exhaust memory: the most real target tokens (the output layer and
    loss) and the most padded tokens (every other activation)."""
    padded = [len(b) * (int(split.src.sizes[b].max()) + int(split.tgt.sizes[b].max()) + 2)
              for b in split.batches]
    return [split.batches[i] for i in sorted({int(np.argmax(split.tgt_tokens)), int(np.argmax(padded))})]


def order_of(split: Split, epoch: int, seed: int) -> np.ndarray:
    return epoch_order(len(split.batches), epoch, seed)


def describe_plan(cfg: TrainConfig, data: Corpus, per_node: int, kind: str, params: int,
                  peak_lr: float) -> str:
    """The dry run's report: model size, devices, batch, accumulation, learning rate, cadence, plan."""
    split, world, M = data.train, data.plan.world_size, data.plan.micro_batches
    assert world == per_node * cfg.launch.nnodes, "the corpus was planned for another number of devices"
    per_epoch = updates_per_epoch(len(split.batches), world, M)
    save, stop = cfg.checkpoint, cfg.stop
    saves = [f"every {save.save_interval_minutes:g} minutes"] if save.save_interval_minutes > 0 else []
    if save.save_interval_updates > 0:
        kept = save.keep_last
        if stop.max_update:  # the cadence's checkpoints and the last one
            kept = min(kept, math.ceil(stop.max_update / save.save_interval_updates))
        span = max(kept - 1, 0) * save.save_interval_updates
        share = f", {span / stop.max_update:.1%} of {stop.max_update:,} updates" if stop.max_update else ""
        saves = [f"numbered every {save.save_interval_updates:,} updates (the last {kept} span "
                 f"{span:,} updates{share})"] + [f"checkpoint_last.pt {s} (crash safety)" for s in saves]
    epochs = stop.max_update / max(per_epoch, 1)
    stops = [f"{stop.max_update:,} updates (about {epochs:,.1f} epochs)"] if stop.max_update else []
    stops += [f"{stop.max_epoch} epochs ({stop.max_epoch * per_epoch:,} updates)"] if stop.max_epoch else []
    stops += [f"{stop.max_time_hours:g} hours"] if stop.max_time_hours else []
    units = "GPU(s)" if kind == "GPU" else f"{kind}(es)"
    return "\n".join([
        f"parameters: {params:,} ({cfg.arch}, vocabulary {len(data.dictionary):,})",
        f"devices: {world} ({cfg.launch.nnodes} node(s) x {per_node} {units})",
        f"max_tokens per device: {cfg.batch.max_tokens:,} (one micro-batch, padding included)",
        f"accumulation: {M} micro-batch(es) per device per update",
        data.plan.describe(cfg.batch),
        f"peak learning rate: {peak_lr:.3e} at update {cfg.optim.warmup_updates} ({cfg.optim.lr_schedule} "
        "schedule)",
        f"checkpoints: {' and '.join(saves) or 'at the end only'}, keep the last {save.keep_last}, plus "
        f"checkpoint_last.pt and checkpoint_best.pt (by validation {save.best_metric})",
        f"validation: every {cfg.valid.interval_updates} updates and at every checkpoint",
        f"data: {sum(map(len, split.batches)):,} training pairs in {len(split.batches):,} batches "
        f"({split.skipped:,} skipped as too long); {per_epoch:,} updates per epoch",
        "plan: " + ("stop at the first of " + ", ".join(stops) if stops else "no limit (stop it by hand)"),
    ])
