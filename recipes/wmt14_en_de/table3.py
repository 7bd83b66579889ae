"""Table 3 of "Attention Is All You Need" (arXiv 1706.03762, section 6.2): every row trained and
evaluated as the paper did, and the table written with the paper's numbers beside ours.

Run through table3.sh (its --help lists the options). For each row of table3/ROW.yaml: print its
parameter count (`nmt train --dry-run`), train it with the base recipe's data, schedule and devices
into WORK/table3/ROW (resumes; a finished row stops at once), translate newstest2013 with its last
checkpoint (no averaging, beam 4, alpha 0.6, at most source length + 50) unless that translation is
newer than the checkpoint, score it, and write WORK/table3/table3.md: perplexity per word piece on
newstest2013 (the last validation of the run), sacreBLEU (with its signature) and the paper's
tokenized BLEU, and the parameter count.

--smoke: every row for two updates on the CPU with each width (d_model, d_ff, d_k, d_v) divided by
16, the layers and heads kept, validated on 4 batches and evaluated on the first 20 sentences of
newstest2013: a check of the recipe, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from nmt_cli.config.train import TrainConfig, resolve_train

HERE = Path(__file__).resolve().parent
ROWS = ["base", "A-h1", "A-h4", "A-h16", "A-h32", "B-dk16", "B-dk32", "C-N2", "C-N4", "C-N8", "C-d256",
        "C-d1024", "C-ff1024", "C-ff4096", "D-drop0.0", "D-drop0.2", "D-ls0.0", "D-ls0.2", "E-learned", "big"]
# The paper's table 3: (the row's group, perplexity, BLEU, parameters in millions or None where blank)
PAPER = {
    "base": ("base", 4.92, 25.8, 65), "A-h1": ("A", 5.29, 24.9, None), "A-h4": ("A", 5.00, 25.5, None),
    "A-h16": ("A", 4.91, 25.8, None), "A-h32": ("A", 5.01, 25.4, None), "B-dk16": ("B", 5.16, 25.1, 58),
    "B-dk32": ("B", 5.01, 25.4, 60), "C-N2": ("C", 6.11, 23.7, 36), "C-N4": ("C", 5.19, 25.3, 50),
    "C-N8": ("C", 4.88, 25.5, 80), "C-d256": ("C", 5.75, 24.5, 28), "C-d1024": ("C", 4.66, 26.0, 168),
    "C-ff1024": ("C", 5.12, 25.4, 53), "C-ff4096": ("C", 4.75, 26.2, 90),
    "D-drop0.0": ("D", 5.77, 24.6, None), "D-drop0.2": ("D", 4.95, 25.5, None),
    "D-ls0.0": ("D", 4.67, 25.3, None), "D-ls0.2": ("D", 5.47, 25.7, None),
    "E-learned": ("E", 4.92, 25.7, None), "big": ("big", 4.33, 26.4, 213),
}
SMOKE_SCALE = 16


def row_config(row: str, data: Path, save_dir: Path, sets: list[str]) -> TrainConfig:
    """The row's training config as `nmt train --config table3/ROW.yaml --set ...` resolves it."""
    return resolve_train(HERE / "table3" / f"{row}.yaml", {"data": data, "save_dir": save_dir}, sets)


def parameters(cfg: TrainConfig, data: Path) -> int:
    """The row's parameter count with the recipe's dictionary, as `nmt train --dry-run` prints it:
    counted on torch's meta device, without allocating the weights."""
    import torch

    from nmt_cli.data.dataset import Dictionary
    from nmt_cli.model.transformer import Transformer, count_parameters

    with torch.device("meta"):
        return count_parameters(Transformer(cfg.model, len(Dictionary.load(data / "dict.txt"))))


def smoke_settings(cfg: TrainConfig) -> list[str]:
    """--set items that shrink the row's widths by SMOKE_SCALE (the layers and heads stay)."""
    m = cfg.model
    widths = {"d_model": m.d_model, "d_ff": m.d_ff, "d_k": m.d_k, "d_v": m.d_v}
    return [f"model.{k}={max(v // SMOKE_SCALE, 1) if v else 0}" for k, v in widths.items()]


def nmt(*args: object, fresh_process: bool) -> None:
    """Run an `nmt` command as typed on the command line; stop the recipe on failure. On the CPU the
    command runs in this process (it parses and fails exactly as the `nmt` program does, and 60
    starts of torch are most of the smoke's time); with GPUs each command is a process of its own, so
    that this one holds no GPU memory while the next row trains."""
    command = [*map(str, args)]
    if fresh_process:
        status = subprocess.run([os.environ.get("NMT", "nmt"), *command]).returncode
    else:
        import torch

        from nmt_cli.cli import app

        threads = torch.get_num_threads()  # translate sets its own; the next row's training wants ours
        try:
            app(command, prog_name="nmt")  # exits as the program does: status 0, 1 or 2, messages printed
        except SystemExit as done:
            status = done.code
        finally:
            torch.set_num_threads(threads)
    if status:
        sys.exit(f"table3: nmt {' '.join(command)} failed (exit status {status})")


def run_row(row: str, args: argparse.Namespace, work: Path) -> dict:
    """Train, translate and score one row; returns what its line of the table needs."""
    save = work / "table3" / row
    sets = smoke_settings(row_config(row, work / "bin", save, [])) if args.smoke else []
    cfg = row_config(row, work / "bin", save, sets)  # what is trained: the smoke model under --smoke
    train = [work / "bin", "--config", HERE / "table3" / f"{row}.yaml", "--save-dir", save, *args.devices,
             *[arg for item in sets for arg in ("--set", item)]]
    if args.smoke:
        train += ["--max-update", 2, "--tokens-per-update", 1000, "--max-tokens", 1000,
                  "--save-interval-updates", 2, "--precision", "fp32",
                  "--set", "checkpoint.save_interval_minutes=0", "--set", "valid.max_batches=4"]
    train += args.train
    params = parameters(cfg, work / "bin")
    print(f"== table 3 row {row}: {params / 1e6:.2f}M parameters", flush=True)
    nmt("train", *train, fresh_process=args.gpus_used)
    last, hyp = save / "checkpoint_last.pt", save / "newstest2013.de"
    source, reference = (dev_set(work, lang, save if args.smoke else None) for lang in ("en", "de"))
    if not (hyp.exists() and hyp.stat().st_mtime > last.stat().st_mtime):
        nmt("translate", last, "--input", source, "--output", hyp, "--beam", 4, "--lenpen", 0.6,
            "--set", "max_len_a=1", "--set", "max_len_b=50", fresh_process=args.gpus_used)
    scores = save / "newstest2013.scores.json"
    if not (scores.exists() and scores.stat().st_mtime > hyp.stat().st_mtime):
        nmt("score", "--hyp", hyp, "--ref", reference, "--langpair", "en-de", "--json", scores,
            fresh_process=args.gpus_used)
    records = [json.loads(line) for line in (save / "train.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"][-1]
    return {"row": row, "cfg": cfg, "params": params, "ppl": valid["ppl"], "update": valid["update"],
            "scores": json.loads(scores.read_text())}


def dev_set(work: Path, lang: str, smoke_dir: Path | None) -> Path:
    """newstest2013 in `lang` as prepared by run.sh, or its first 20 lines in `smoke_dir`."""
    path = work / "raw" / f"valid.{lang}"
    if smoke_dir is None:
        return path
    first = path.read_text(encoding="utf-8").splitlines(keepends=True)[:20]
    (smoke_dir / path.name).write_text("".join(first), encoding="utf-8")
    return smoke_dir / path.name


def table(results: list[dict]) -> str:
    """The table in the paper's layout, each measured figure with the paper's beside it."""
    head = ("| row | N | d_model | d_ff | h | d_k | d_v | P_drop | eps_ls | steps | PPL (dev) | paper | "
            "BLEU (dev) | tok. BLEU | paper | params x10^6 | paper |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        m, cfg = r["cfg"].model, r["cfg"]
        group, ppl, bleu, params = PAPER[r["row"]]
        d_k, d_v = m.head_widths
        name = r["row"] if group == r["row"] else f"({group}) {r['row']}"
        cells = [name, m.encoder_layers, m.d_model, m.d_ff, m.heads, d_k, d_v, m.dropout,
                 cfg.optim.label_smoothing, f"{r['update'] / 1000:g}K", f"{r['ppl']:.2f}", f"{ppl:.2f}",
                 f"{r['scores']['sacrebleu']['score']:.1f}", f"{r['scores']['tokenized_bleu']['score']:.1f}",
                 f"{bleu:.1f}", f"{r['params'] / 1e6:.{0 if r['params'] >= 1e7 else 2}f}", params or ""]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    signature = results[0]["scores"]["sacrebleu"]["signature"] if results else ""
    return ("\n".join(lines) + "\n\nDev: newstest2013, the last checkpoint of each run (no averaging), "
            "beam 4, "
            f"alpha 0.6. PPL: per word piece. BLEU: sacreBLEU {signature}; tok. BLEU: the paper's tokenized "
            "BLEU. The paper's columns: arXiv 1706.03762, table 3.\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="table3.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=" ".join(ROWS), help="rows to run, space-separated [all 20]")
    parser.add_argument("--work", type=Path, default=Path("work/wmt14_en_de"),
                        help="the folder of run.sh (its data is prepared there first) [work/wmt14_en_de]")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs on this machine [8]")
    parser.add_argument("--nproc", type=int, default=0, help="N CPU workers instead of GPUs")
    parser.add_argument("--smoke", action="store_true",
                        help="every row for two updates, widths / 16, on the CPU")
    parser.add_argument("--from", dest="from_dir",
                        help="folder of the downloaded WMT14 archives (run.sh --from)")
    parser.add_argument("--mirror", help="base URL of a mirror of statmt.org (run.sh --mirror)")
    parser.add_argument("--checksums", help="checksums file (run.sh --checksums)")
    parser.add_argument("train", nargs="*", help="after --: options passed on to nmt train")
    args = parser.parse_args()
    rows = args.rows.split()
    unknown = [r for r in rows if r not in PAPER]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; the rows: {' '.join(ROWS)}")
    args.devices = ["--nproc", args.nproc, "--device", "cpu"] if args.nproc else ["--gpus", args.gpus]
    if args.smoke and not args.nproc:
        args.devices = ["--device", "cpu"]
    args.gpus_used = args.devices[0] == "--gpus"
    data = [opt for name in ("from_dir", "mirror", "checksums") if getattr(args, name)
            for opt in (f"--{name.replace('_dir', '')}", getattr(args, name))]
    if (args.work / "bin" / "manifest.json").exists():
        print(f"== the base recipe's data: ready in {args.work}/bin", flush=True)
    else:
        print("== the base recipe's data: run.sh stages 1-3", flush=True)
        done = subprocess.run(["bash", HERE / "run.sh", "--work", args.work, "--until", "3", *data,
                               *(["--smoke"] if args.smoke else [])])
        if done.returncode != 0:
            sys.exit(f"table3: run.sh stages 1-3 failed (exit status {done.returncode})")
    results = [run_row(row, args, args.work) for row in rows]
    out = args.work / "table3" / "table3.md"
    out.write_text(table(results), encoding="utf-8")
    print(table(results), end="")
    print(f"table3: wrote {out}")


if __name__ == "__main__":
    main()
