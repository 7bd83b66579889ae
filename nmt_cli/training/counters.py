"""Where a training run stands: updates, epochs, the best validation so far and what was skipped.
Saved in every checkpoint (resume.py), read by the limits of guard.py."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Counters:
    """Where training stands; saved in every checkpoint."""

    update: int = 0
    epoch: int = 1
    epoch_batches_done: int = 0  # batches of the epoch order already trained on (all ranks together)
    train_seconds: float = 0.0
    best_valid_loss: float | None = None
    best_valid_bleu: float | None = None
    valid_loss: float | None = None  # of the last validation
    bad_updates: int = 0  # updates skipped in a row for non-finite values
    skipped_updates: int = 0  # updates skipped for any reason since the start (non-finite, all out of memory)
    oom_micro_batches: int = 0  # micro-batches dropped for running out of memory, all ranks
    micro_batches: int = 0  # micro-batches planned so far, all ranks (what oom_micro_batches is a share of)
    stop_requested: bool = False
    log_sums: dict[str, float] = dataclasses.field(default_factory=dict)
