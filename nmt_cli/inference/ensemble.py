"""Ensembles: several models that share a dictionary, searched as one (`nmt translate A.pt B.pt ...`,
fairseq's `--path a.pt:b.pt`).

`Ensemble` is a `beams.SearchModel`, the interface the search drives, so the search does not know it is
running several models. Each step its scores
are the mean of the members' log-probabilities, log P(y | ...) = (1/M) sum_m log P_m(y | ...), not
renormalised: a hypothesis' log-probability is then the mean of the members' log-probabilities of it,
and so is its score. `scores_are_log_probs` tells `beams.best_tokens` not to normalise them again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor, nn

from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model.transformer import Cache, Encoded, Slots, Transformer


class Ensemble(nn.Module):
    scores_are_log_probs = True

    def __init__(self, members: list[Transformer]) -> None:
        super().__init__()
        if len({m.output_vocab for m in members}) > 1:
            raise NmtError("an ensemble's models must score the same target vocabulary (model.output_vocab)")
        self.members = nn.ModuleList(members)
        # the longest input every member reads
        longest = min(m.cfg.max_positions for m in members)
        self.cfg = dataclasses.replace(members[0].cfg, max_positions=longest)
        self.vocab_size = members[0].vocab_size
        self.output_vocab = members[0].output_vocab

    def encode(self, src: Tensor) -> list[Encoded]:
        return [m.encode(src) for m in self.members]

    def start_decoding(self, enc: list[Encoded]) -> list[Cache]:
        return [m.start_decoding(e) for m, e in zip(self.members, enc, strict=True)]

    def decode_step(self, tokens: Tensor, step: int, enc: list[Encoded], cache: list[Cache],
                    beams: Slots | None = None) -> Tensor:
        """(N, V) the mean of the members' log-probabilities of the next token."""
        total = None
        for m, e, c in zip(self.members, enc, cache, strict=True):
            log_probs = torch.log_softmax(m.decode_step(tokens, step, e, c, beams).float(), dim=-1)
            total = log_probs if total is None else total + log_probs
        return total / len(self.members)

    def reorder(self, enc: list[Encoded], cache: list[Cache], order: Tensor,
                sentences: Tensor | None = None) -> tuple[list[Encoded], list[Cache]]:
        pairs = [Transformer.reorder(e, c, order, sentences) for e, c in zip(enc, cache, strict=True)]
        return [e for e, _ in pairs], [c for _, c in pairs]


def check_members(paths: list[Path], dictionaries: list[Dictionary], spm_models: list[bytes]) -> None:
    """Refuse members that do not read and write the same symbols, naming the files."""
    for path, dictionary, spm_model in zip(paths[1:], dictionaries[1:], spm_models[1:], strict=True):
        if dictionary.symbols != dictionaries[0].symbols:
            raise NmtError(f"an ensemble's models must share a dictionary: {path} has another than "
                           f"{paths[0]} ({len(dictionary)} and {len(dictionaries[0])} symbols)")
        if spm_model != spm_models[0]:
            raise NmtError(f"an ensemble's models must share a sentencepiece model: {path} has another than "
                           f"{paths[0]}")
