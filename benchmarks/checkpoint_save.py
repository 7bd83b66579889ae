"""How long one checkpoint save holds up the training thread: `checkpoint.save_training` run in it
(hash, write, links: how `nmt train` saved before its saves went to the background) against
`checkpoint.Saver.submit` (a copy of the state in CPU memory; the hashing and writing go on in a
thread), and when the file is in place. The state is a model's weights and its Adam moments, as
`nmt train` writes them, on the device asked for, written into a temporary folder under --dir.

    python benchmarks/checkpoint_save.py [--arch transformer_base] [--vocab 37000] [--device cpu]
                                         [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from nmt_cli.config.model import ARCHS  # noqa: E402
from nmt_cli.data.dataset import SPECIALS, Dictionary  # noqa: E402
from nmt_cli.model.file import model_description  # noqa: E402
from nmt_cli.model.transformer import Transformer  # noqa: E402
from nmt_cli.training import checkpoint  # noqa: E402


def training_state(arch: str, vocab: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an Adam optimiser one step in, so that both moments exist."""
    torch.manual_seed(0)
    model = Transformer(ARCHS[arch], vocab).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, arch: str, vocab: int,
             update: int) -> dict[str, Any]:
    """What `resume.training_checkpoint` hands to the save, less the counters: the live tensors."""
    symbols = [*SPECIALS, *(f"w{i}" for i in range(vocab - len(SPECIALS)))]
    dictionary = Dictionary(symbols, [1] * vocab)
    return {"kind": "checkpoint", **model_description(ARCHS[arch], dictionary, b"\0" * 800_000),
            "model": {k: v.detach() for k, v in model.state_dict().items()},
            "meta": {"update": update},
            "train": {"update": update, "optimizer": optimizer.state_dict(),
                      "rng": [{"torch": torch.get_rng_state(), "cuda": None}]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="transformer_base", choices=sorted(ARCHS))
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    model, optimizer = training_state(args.arch, args.vocab, args.device)
    params = sum(p.numel() for p in model.parameters())
    print(describe())
    print(f"{args.arch}, vocabulary {args.vocab}: {params / 1e6:.1f}M parameters + Adam moments, on "
          f"{args.device}; median of {args.repeats} saves\n")
    print("| save | blocks training (s) | file in place after (s) | file (MB) |")
    print("|---|---:|---:|---:|")
    saver = checkpoint.Saver(lambda text: None, print)
    for way in ("save_training in the training thread", "Saver.submit, written in a thread"):
        blocked, written, size = [], [], 0
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            for update in range(1, args.repeats + 1):
                state = state_of(model, optimizer, args.arch, args.vocab, update)
                start = time.perf_counter()
                if way.startswith("Saver"):
                    saver.submit(Path(folder), update, state, best=False, keep_last=2)
                    blocked.append(time.perf_counter() - start)
                    saver.wait()
                else:  # the weights copied to the CPU, as `model.file.model_state` does
                    state["model"] = {k: v.cpu() for k, v in state["model"].items()}
                    checkpoint.save_training(Path(folder), update, state, best=False, keep_last=2)
                    blocked.append(time.perf_counter() - start)
                written.append(time.perf_counter() - start)
                size = (Path(folder) / checkpoint.LAST).stat().st_size
        print(f"| {way} | {statistics.median(blocked):.2f} | {statistics.median(written):.2f} | "
              f"{size / 1e6:.0f} |")


if __name__ == "__main__":
    main()
