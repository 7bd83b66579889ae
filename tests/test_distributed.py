"""The torchrun launcher's command line (the distributed training itself is in test_train.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nmt_cli.config.core import resolve
from nmt_cli.config.train import LaunchConfig, LogConfig, OptimConfig, StopConfig, TrainConfig, train_base
from nmt_cli.training.distributed import torchrun_arguments, worker_arguments


def _cfg(**changes: object) -> TrainConfig:
    cfg = dataclasses.replace(train_base("transformer_big"), data=Path("data/bin"), save_dir=Path("ckpt"),
                              **changes)
    cfg.model.dropout = 0.1
    return cfg


def test_workers_rebuild_the_same_config() -> None:
    cfg = _cfg(launch=LaunchConfig(gpus=8), optim=OptimConfig(adam_betas=(0.9, 0.997), lr=5e-4),
               log=LogConfig(tensorboard_dir=Path("tb")), stop=StopConfig(max_update=300000))
    args = worker_arguments(cfg)
    assert args[:5] == ["data/bin", "--save-dir", "ckpt", "--arch", "transformer_big"]
    sets = [a for flag, a in zip(args[5::2], args[6::2], strict=True) if flag == "--set"]
    rebuilt = resolve(TrainConfig, None, {"data": args[0], "save_dir": args[2], "arch": args[4]}, sets,
                      base=train_base(args[4]))
    assert rebuilt == cfg
    assert {"--set", "optim.lr=0.0005", "launch.gpus=8", "stop.max_update=300000"} <= set(args)


def test_torchrun_gets_the_multi_node_options() -> None:
    launch = LaunchConfig(gpus=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500", max_restarts=3)
    args = torchrun_arguments(_cfg(launch=launch), 8)
    flat = " ".join(args)
    for option in ("--nproc-per-node 8", "--nnodes 2", "--node-rank 1", "--rdzv-endpoint node0:29500",
                   "--max-restarts 3", "-m nmt_cli.worker data/bin"):
        assert option in flat
    single = torchrun_arguments(_cfg(launch=LaunchConfig(nproc=2)), 2)
    assert "--standalone" in single and "--rdzv-endpoint" not in single
