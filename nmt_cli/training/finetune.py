"""`nmt train --init MODEL.pt`: a run that starts from a model file's weights (fine-tuning), an
imported fairseq model included, instead of a random initialisation.

The model file's own model settings replace `model.*` (its weights fit nothing else), and the data
must have been binarized with the file's dictionary and sentencepiece model (and its target side's
own model, an imported MarianMT model's), since every embedding row belongs to one symbol; the run's
checkpoints carry the data's models, so they are the file's. A run that resumes from its own
checkpoints never reads the file again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nmt_cli.config.train import TrainConfig
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import load_weights
from nmt_cli.training.corpus import Corpus


def with_init_model(cfg: TrainConfig) -> TrainConfig:
    """cfg with the model settings of its --init file (unchanged without one)."""
    if cfg.init is None:
        return cfg
    state = model_file.load(Path(cfg.init))
    return dataclasses.replace(cfg, model=model_file.model_config_of(state, Path(cfg.init)))


def load_init_weights(model: torch.nn.Module, cfg: TrainConfig, data: Corpus) -> None:
    """Copy the --init file's weights into `model`, after checking that the data speaks its vocabulary."""
    path = Path(cfg.init)
    state = model_file.load(path)
    symbols = list(state["dictionary"]["symbols"])
    fix = ("binarize the data with the model's sentencepiece model and dictionary (`nmt bpe --model`, "
           "`nmt binarize --dictionary`)")
    if symbols != list(data.dictionary.symbols):
        pairs = enumerate(zip(symbols, data.dictionary.symbols, strict=False))
        first = next((i for i, (a, b) in pairs if a != b),
                     min(len(symbols), len(data.dictionary)))
        raise NmtError(f"{path}'s dictionary ({len(symbols)} symbols) is not {data.folder}/dict.txt "
                       f"({len(data.dictionary)} symbols; they differ from id {first}): {fix}")
    if bytes(state["spm_model"]) != data.spm_model:
        raise NmtError(f"{path}'s sentencepiece model is not the one of {data.folder}: {fix}")
    if model_file.target_spm_of(state) != data.target_spm:  # an imported MarianMT model's target.spm
        raise NmtError(f"{path}'s target sentencepiece model is not the one of {data.folder}: split the "
                       "text with the model's own two (`nmt bpe --model SOURCE --target-model TARGET`)")
    load_weights(model, state["model"], str(path))
