"""`nmt average`: the element-wise mean of the weights of several checkpoints (the paper's final model:
the last 5 checkpoints for base, the last 20 for big, written every 10 minutes; section 6.1).

The mean is accumulated in fp32 one checkpoint at a time, so memory holds the running sum and one
loaded checkpoint, never all N. Each tensor keeps its original dtype in the output. The model has
one embedding matrix shared by source, target and output projection, stored under one key, so the
average keeps the three tied. The output is a weights-only model file (no optimiser state) that
names the checkpoints it averaged.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli.artifacts import check_output_file
from nmt_cli.config.train import AverageConfig
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.training import checkpoint


def average_states(states: Iterable[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Element-wise mean of state dicts with the same keys and shapes, summed in fp32 one at a time;
    each result has its input's dtype. Integer tensors (counters, not weights) are taken from the last."""
    total: dict[str, Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    count = 0
    for state in states:
        if count == 0:
            dtypes = {k: v.dtype for k, v in state.items()}
            total = {k: v.detach().to(torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                     for k, v in state.items()}
        else:
            assert state.keys() == total.keys(), "states differ in their keys"
            for k, v in state.items():
                assert v.shape == total[k].shape, f"{k}: shapes differ"
                if v.is_floating_point():
                    total[k] += v.detach().float()
                else:
                    total[k] = v.detach().clone()
        count += 1
    assert count > 0, "nothing to average"
    return {k: (v / count).to(dtypes[k]) if dtypes[k].is_floating_point else v for k, v in total.items()}


def select_checkpoints(cfg: AverageConfig) -> list[Path]:
    """The files to average: the last `cfg.last` numbered checkpoints of one folder, or the files given."""
    paths = [Path(p) for p in cfg.checkpoints]
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        found = checkpoint.numbered_checkpoints(folder)
        if cfg.last < 1:
            raise NmtError(f"--last must be at least 1, got {cfg.last}")
        if not found:
            raise NmtError(f"{folder} holds no checkpoint_<update>.pt files; pass the folder `nmt train` "
                           "saved into (its --save-dir) or checkpoint files")
        if len(found) < cfg.last:
            names = ", ".join(p.name for _, p in found)
            raise NmtError(f"{folder} holds {len(found)} numbered checkpoints ({names}) but --last asks for "
                           f"{cfg.last}; pass --last {len(found)} or fewer, or train longer")
        return [p for _, p in found[-cfg.last:]]
    for p in paths:
        if p.is_dir():
            raise NmtError(f"{p} is a folder; give either one checkpoint folder (with --last) "
                           "or checkpoint files")
        if not p.is_file():
            raise NmtError(f"{p} does not exist")
    return paths


def _check_compatible(first: dict[str, Any], first_path: Path, other: dict[str, Any], path: Path) -> None:
    """Refuse to average models of different shapes, vocabularies or sentencepiece models."""
    # compared with their defaults filled in, so files of several nmt versions compare by what they hold
    mine = dataclasses.asdict(model_file.model_config_of(first, first_path))
    theirs = dataclasses.asdict(model_file.model_config_of(other, path))
    if mine != theirs:
        fields = "; ".join(model_file.differing_fields(mine, theirs))
        raise NmtError(f"{first_path} and {path} have different model configs ({fields}); "
                       "only checkpoints of one training run can be averaged")
    if other["dictionary"]["symbols"] != first["dictionary"]["symbols"]:
        raise NmtError(f"{first_path} and {path} have different dictionaries; "
                       "only checkpoints of one training run can be averaged")
    if (bytes(other["spm_model"]), model_file.target_spm_of(other)) != (bytes(first["spm_model"]),
                                                                        first["target_spm"]):
        raise NmtError(f"{first_path} and {path} have different sentencepiece models; "
                       "only checkpoints of one training run can be averaged")


def _update_of(state: dict[str, Any], path: Path) -> int | None:
    update = state.get("meta", {}).get("update")
    if type(update) is not int and (m := checkpoint.NUMBERED.fullmatch(path.name)):
        update = int(m.group(1))
    return update if type(update) is int else None


def run(cfg: AverageConfig) -> None:
    paths = select_checkpoints(cfg)
    out = Path(cfg.out)
    check_output_file(out, "--out")
    if any(out.resolve() == p.resolve() for p in paths):
        raise NmtError(f"--out {out} is one of the checkpoints being averaged; choose another file")
    first: dict[str, Any] = {}
    averaged: list[dict[str, Any]] = []

    def states() -> Iterable[dict[str, Tensor]]:
        for path in paths:
            state = model_file.load(path)
            if not first:  # keep what describes the model, not the weights or training state
                model_file.model_config_of(state, path)
                first.update({k: state[k] for k in ("model_config", "dictionary", "spm_model")}, path=path,
                             source_normalization=state.get("source_normalization"),
                             target_spm=model_file.target_spm_of(state),
                             langs={k: state.get("meta", {}).get(k) for k in ("src_lang", "tgt_lang")})
                first["shapes"] = {k: v.shape for k, v in state["model"].items()}
            else:
                _check_compatible(first, first["path"], state, path)
            if {k: v.shape for k, v in state["model"].items()} != first["shapes"]:
                raise NmtError(f"{path}: its weights do not have the names and shapes of those in "
                               f"{first['path']} (the file is damaged, or was not written by nmt)")
            averaged.append({"file": str(path), "update": _update_of(state, path)})
            print(f"average: read {path} (update {averaged[-1]['update']})", file=sys.stderr)
            yield state.pop("model")

    weights = average_states(states())
    meta = {**{k: v for k, v in first["langs"].items() if v is not None},  # for a model card
            "averaged": averaged, "updates": [a["update"] for a in averaged],
            "update": max((a["update"] for a in averaged if a["update"] is not None), default=None)}
    model_file.save(out, {"kind": "model", "meta": meta, "model": weights,
                          "model_config": first["model_config"], "dictionary": first["dictionary"],
                          "spm_model": bytes(first["spm_model"]),
                          "source_normalization": first["source_normalization"],
                          # the target side's own model, where the checkpoints have one
                          **({} if first["target_spm"] == bytes(first["spm_model"])
                             else {"target_spm_model": first["target_spm"]})})
    print(f"average: wrote the mean of {len(paths)} checkpoints to {out}", file=sys.stderr)
