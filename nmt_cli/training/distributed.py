"""Where training runs: one process, or torchrun workers joined in a process group; and in which precision.

`nmt train` on a machine with several GPUs (or with ``--nproc N`` on a CPU) starts torchrun through
`torch.distributed.run`, whose workers run ``python -m nmt_cli.worker`` with the same settings; a
worker sees WORLD_SIZE and LOCAL_RANK in its environment and trains instead of launching. Only
`train` and this module touch torch.distributed; the model, data and search code never do.
Backends: nccl between GPUs, gloo between CPU processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from nmt_cli.config.core import flatten, to_dict
from nmt_cli.config.train import TrainConfig, train_base
from nmt_cli.errors import NmtError
from nmt_cli.model.cpu import this_cpu


@dataclasses.dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def in_worker() -> bool:
    """True inside a process started by torchrun (which sets WORLD_SIZE and LOCAL_RANK)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def use_cuda(cfg: TrainConfig) -> bool:
    if cfg.launch.nproc > 0 or cfg.device == "cpu":
        return False
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise NmtError("--device cuda was asked for but torch sees no CUDA device; use --device cpu "
                       "or install a CUDA build of torch")
    return torch.cuda.is_available()


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """auto: bf16 where the device multiplies bf16 fast (a CUDA GPU with bf16, a CPU with
    AVX512-BF16 or AMX whose bf16 products also measure faster than fp32: `model.cpu`), else fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if this_cpu().fast_bf16 else "fp32"


def processes_per_node(cfg: TrainConfig, planning: bool = False) -> int:
    """Workers to start on this machine: --nproc CPU workers, --gpus GPUs, or every visible GPU.

    `planning` (the dry run) trusts --gpus without checking that the GPUs exist."""
    if cfg.launch.nproc > 0 and cfg.launch.gpus > 0:
        raise NmtError("--nproc (CPU workers) and --gpus cannot be combined; choose one")
    if cfg.launch.nproc > 0:
        return cfg.launch.nproc
    if cfg.launch.gpus > 0:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not planning and visible < cfg.launch.gpus:
            raise NmtError(f"--gpus {cfg.launch.gpus} was asked for but this machine has {visible} usable "
                           "GPU(s); lower --gpus, or use --dry-run to plan for a bigger machine")
        return cfg.launch.gpus
    return torch.cuda.device_count() if use_cuda(cfg) else 1


def worker_arguments(cfg: TrainConfig) -> list[str]:
    """The `nmt train` arguments that rebuild `cfg` in a worker: the data folder, then every field
    that differs from the preset of cfg.arch as ``--set key=value`` (``--set optim.lr=0.001``)."""
    base = flatten(to_dict(train_base(cfg.arch)))
    args = [str(cfg.data), "--save-dir", str(cfg.save_dir), "--arch", cfg.arch]
    for key, value in flatten(to_dict(cfg)).items():
        if key not in ("data", "save_dir", "arch") and value != base.get(key):
            args += ["--set", f"{key}={_cli_value(value)}"]
    return args


def _cli_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def torchrun_arguments(cfg: TrainConfig, nproc_per_node: int) -> list[str]:
    """Arguments of `torch.distributed.run` that start this node's workers."""
    args = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(cfg.launch.nnodes),
            "--max-restarts", str(cfg.launch.max_restarts)]
    if cfg.launch.nnodes > 1 or cfg.launch.rdzv_endpoint:
        if not cfg.launch.rdzv_endpoint:
            raise NmtError(f"--nnodes {cfg.launch.nnodes} needs --rdzv-endpoint HOST:PORT (the machine of "
                           "node 0)")
        args += ["--node-rank", str(cfg.launch.node_rank), "--rdzv-endpoint", cfg.launch.rdzv_endpoint]
    else:
        args.append("--standalone")  # a free local port: parallel runs on one machine do not collide
    return [*args, "-m", "nmt_cli.worker", *worker_arguments(cfg)]


def launch(cfg: TrainConfig, nproc_per_node: int) -> None:
    """Start torchrun in this process and wait for its workers; they print their own errors."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if cfg.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the workers report their own failures
    try:
        torchrun.run(torchrun.parse_args(torchrun_arguments(cfg, nproc_per_node)))
    except ChildFailedError as e:
        # exit code 2 is a user error that rank 0 has printed; torchrun then stops the other workers
        if any(failure.exitcode == 2 for failure in e.failures.values()):
            raise SystemExit(2) from None
        summary = "; ".join(f"rank {rank}: exit code {f.exitcode}" for rank, f in e.failures.items())
        raise NmtError(f"a training worker failed ({summary}); see its output above. Rerun the same "
                       f"command to resume from {cfg.save_dir}/checkpoint_last.pt") from None


def setup(cfg: TrainConfig) -> Context:
    """Join the process group when run by torchrun; otherwise a single process."""
    cuda = use_cuda(cfg)
    if not in_worker():
        return Context(0, 1, 0, torch.device("cuda" if cuda else "cpu"))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        # torchrun's restarted workers meet in the store the dead group used, where its addresses are
        # still written: a new worker could read a dead peer's address and fail to connect (pytorch
        # issue 167288). Each restart gets keys of its own.
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"nmt/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device if cuda else None)
    return Context(rank, world, local, device)


def lost_peer(error: BaseException) -> bool:
    """True when a collective failed because another worker died (gloo: its connection closed or was
    reset; NCCL: the communicator was aborted): that worker's output says why, this one has nothing to add."""
    text = str(error)
    return isinstance(error, dist.DistNetworkError) or (isinstance(error, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                  "communicator was aborted")))


def teardown(ctx: Context) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: Context) -> nn.Module:
    """DDP around the model when there are several workers (gradients averaged across them)."""
    if not ctx.distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # the only buffer is the sinusoid table, the same on every worker: no need to sync it at each forward
    # (torch before 2.7 names that broadcast_buffers, which later versions still take)
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers")
    return DistributedDataParallel(model, device_ids=ids, **{no_sync: False})


_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally unless `sync` (the update's last
    micro-batch), whose backward all-reduces the sum of them all."""
    if sync or not isinstance(model, DistributedDataParallel):
        yield
    else:
        with model.no_sync():
            yield


def all_reduce_sum(values: list[float], ctx: Context) -> list[float]:
    """Element-wise sums of `values` over all workers (float64, so token counts stay exact)."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_(t: Tensor, ctx: Context) -> Tensor:
    """Sum `t` over all workers in place, on the device: the host does not wait for it."""
    if ctx.distributed:
        dist.all_reduce(t)
    return t


def all_gather(obj: Any, ctx: Context) -> list[Any]:
    """Every worker's `obj`, in rank order (small objects: RNG states)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, ctx: Context) -> Any:
    """Rank 0's `obj` on every worker."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
