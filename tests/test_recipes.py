"""The WMT14 recipes run end to end in smoke mode on the CPU, their real configuration plans 8 GPUs,
and two machines (simulated by two launchers on this one) train together.

Smoke mode runs every stage for real, sized for a CPU: WMT14 archives in the real layout (built by
tests/fake_statmt.py from the shared data) served by a local stand-in for statmt.org, a tiny model,
a few updates on two gloo workers standing in for GPUs, the first 100 test sentences.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, nmt
from fake_statmt import FakeStatmt, checksums_file, wmt14_archives
from nmt_cli.model import file as model_file

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
       "PYTHONUNBUFFERED": "1"}


def run_recipe(pair: str, work: Path, *args: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", f"recipes/wmt14_{pair.replace('-', '_')}/run.sh", "--work", str(work),
                           *map(str, args)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"run.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def archives(shared_data: Path) -> dict[str, dict]:
    return wmt14_archives(shared_data)


def smoke(pair: str, archives: dict[str, dict], work: Path) -> subprocess.CompletedProcess:
    sums = checksums_file(archives, work.parent / "SHA256SUMS")
    with FakeStatmt({path: archive["bytes"] for path, archive in archives.items()}) as site:
        return run_recipe(pair, work, "--smoke", "--nproc", 2, "--mirror", site.url, "--checksums", sums)


@pytest.fixture(scope="module")
def en_de(archives: dict[str, dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("recipe") / "work"
    return work, smoke("en-de", archives, work).stdout


def _check_every_stage(work: Path, output: str, src: str, tgt: str) -> None:
    for number, stage in enumerate(("prepare", "bpe", "binarize", "train", "average", "translate",
                                    "score"), 1):
        assert f"== stage {number}: {stage}" in output
    for folder, stage in (("raw", "prepare"), ("bpe", "bpe"), ("bin", "binarize")):
        assert json.loads((work / folder / "manifest.json").read_text())["stage"] == stage
    model = model_file.load(work / "big" / "averaged.pt")
    assert model["kind"] == "model" and len(model["meta"]["averaged"]) == 2
    last = model_file.load(work / "big" / "checkpoint_last.pt")
    assert last["train"]["world_size"] == 2 and last["train"]["update"] == 6
    assert last["model_config"]["dropout"] == (0.3 if tgt == "de" else 0.1)  # from the recipe's big YAML
    hyp = (work / "big" / f"newstest2014.{tgt}").read_text(encoding="utf-8")
    assert hyp.count("\n") == 100
    scores = json.loads((work / "big" / "newstest2014.scores.json").read_text())
    assert {"sacrebleu", "chrf", "tokenized_bleu"} <= set(scores)


def test_en_de_recipe_runs_every_stage(en_de: tuple[Path, str]) -> None:
    work, output = en_de
    _check_every_stage(work, output, "en", "de")
    assert json.loads((work / "raw" / "manifest.json").read_text())["splits"]["test"]["lines"] == 3003


def test_en_fr_recipe_runs_every_stage(archives: dict[str, dict], tmp_path: Path) -> None:
    work = tmp_path / "work"
    _check_every_stage(work, smoke("en-fr", archives, work).stdout, "en", "fr")


def test_rerunning_the_recipe_skips_finished_stages(en_de: tuple[Path, str]) -> None:
    work, _ = en_de
    before = {p: p.stat().st_mtime_ns for p in (work / "bin").iterdir()}
    proc = run_recipe("en-de", work, "--smoke", "--nproc", 2, "--stage", 2)  # no network needed from stage 2
    assert "== stage 1" not in proc.stdout
    assert proc.stderr.count("nothing to do:") == 2  # bpe and binarize skip; train says it is done
    assert "already trained to update 6" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in (work / "bin").iterdir()} == before


# Every row of the paper's table 3, in its order (table3.sh runs them all when --rows is not given).
TABLE3_ROWS = ("base A-h1 A-h4 A-h16 A-h32 B-dk16 B-dk32 C-N2 C-N4 C-N8 C-d256 C-d1024 C-ff1024 C-ff4096 "
               "D-drop0.0 D-drop0.2 D-ls0.0 D-ls0.2 E-learned big")


def _table3(work: Path, rows: str | None) -> subprocess.CompletedProcess:
    """table3.sh --smoke on `work`: the rows named, or all of them."""
    proc = subprocess.run(["bash", "recipes/wmt14_en_de/table3.sh", "--smoke", "--work", str(work),
                           *(["--rows", rows] if rows else [])],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"table3.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_table3_smoke_trains_evaluates_and_tabulates_each_row(en_de: tuple[Path, str]) -> None:
    """table3.sh --smoke on the recipe's data: each row trained with its own setting (widths / 16),
    translated and scored on newstest2013, and the table written with the paper's numbers beside."""
    work, _ = en_de
    proc = _table3(work, None)
    table = (work / "table3" / "table3.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row")]
    assert [line.split(" | ")[0].split()[-1] for line in rows] == TABLE3_ROWS.split()
    assert "| (A) A-h32 | 6 | 32 | 128 | 32 | 1 | 1 | 0.1 | 0.1 | 0.002K |" in table
    assert "| 4.92 |" in table and "| 213 |" in table  # the paper's base perplexity and big parameters
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in table  # sacreBLEU's signature
    settings = {row: model_file.load(work / "table3" / row / "checkpoint_last.pt")["model_config"]
                for row in TABLE3_ROWS.split()}
    assert (settings["A-h32"]["heads"], settings["A-h32"]["d_k"]) == (32, 1)
    assert (settings["B-dk16"]["d_k"], settings["B-dk16"]["d_v"]) == (1, 0)
    assert settings["C-N2"]["encoder_layers"] == 2 and settings["E-learned"]["positions"] == "learned"
    assert (settings["big"]["d_model"], settings["big"]["dropout"]) == (64, 0.3)
    for row in TABLE3_ROWS.split():
        assert (work / "table3" / row / "newstest2013.de").read_text(encoding="utf-8").count("\n") == 20
        assert f"== table 3 row {row}: " in proc.stdout
    hyp = work / "table3" / "base" / "newstest2013.de"
    before = hyp.stat().st_mtime_ns
    again = _table3(work, "base")  # a finished row: nothing trained or translated again
    assert "already trained to update 2" in again.stderr and hyp.stat().st_mtime_ns == before


def test_table3_stops_at_a_failing_stage_with_its_message(en_de: tuple[Path, str], tmp_path: Path) -> None:
    """The stages run inside the driver on the CPU: a stage's user error still stops the recipe with
    the stage's own message and the command that failed, not a traceback."""
    work, _ = en_de
    proc = subprocess.run(["bash", "recipes/wmt14_en_de/table3.sh", "--smoke", "--work", str(work),
                           "--rows", "A-h4", "--", "--set", "optim.no_such_key=1"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no_such_key" in proc.stderr and "table3: nmt train" in proc.stderr
    assert "failed (exit status 2)" in proc.stderr


def test_table3_refuses_an_unknown_row(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "recipes/wmt14_en_de/table3.sh", "--work", str(tmp_path),
                           "--rows", "base F"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown row(s) F" in proc.stderr and not (tmp_path / "bin").exists()


def test_real_configuration_plans_eight_gpus(en_de: tuple[Path, str], tmp_path: Path) -> None:
    work, _ = en_de
    for model, peak in (("big", "4.941e-04"), ("base", "6.988e-04")):  # d_model^-0.5 * 4000^-0.5
        out = nmt("train", work / "bin", "--config", REPO / f"recipes/wmt14_en_de/transformer_{model}.yaml",
                  "--save-dir", tmp_path / model, "--gpus", 8, "--dry-run").stdout
        for needle in ("devices: 8 (1 node(s) x 8 GPU(s))", "max_tokens per device: 4,096", "accumulation:",
                       "tokens per update: 25,000", f"peak learning rate: {peak}", "every 10 minutes"):
            assert needle in out, out
        assert not (tmp_path / model).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_train_together(en_de: tuple[Path, str], tmp_path: Path) -> None:
    """Two launchers (as on two GPU nodes) rendezvous over TCP, train together, write one checkpoint set."""
    work, _ = en_de
    save, port = tmp_path / "run", _free_port()
    common = ["train", work / "bin", "--save-dir", save, "--arch", "transformer_tiny", "--max-update", 4,
              "--tokens-per-update", 2000, "--max-tokens", 1000, "--save-interval-updates", 2,
              "--precision", "fp32", "--device", "cpu", "--nnodes", 2, "--nproc", 1,
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--set", "log.interval=1",
              "--set", "valid.max_batches=4"]  # all of newstest2013 would take minutes
    nodes = [subprocess.Popen([sys.executable, "-m", "nmt_cli", *map(str, common), "--node-rank", str(rank)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert sorted(p.name for p in save.glob("checkpoint_*.pt")) == [
        "checkpoint_2.pt", "checkpoint_4.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    last = model_file.load(save / "checkpoint_last.pt")
    assert last["train"]["world_size"] == 2 and len(last["train"]["rng"]) == 2
    updates = [r["update"] for r in map(json.loads, (save / "train.jsonl").read_text().splitlines())
               if r["kind"] == "train"]
    assert updates == [1, 2, 3, 4]  # written once, by the first machine's rank 0
