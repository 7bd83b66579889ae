"""benchmarks/gpu_check.sh, as far as a machine without a GPU can check it: its syntax, its arguments,
its refusal without a GPU, and the table it ends with. (GPU_CHECK_REHEARSAL=1 runs all its steps on
the CPU in about 5 minutes: too long for the suite, run by hand.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    help_text = run("--help")
    assert help_text.returncode == 0 and "--gpus N" in help_text.stdout and "set -euo" not in help_text.stdout


@pytest.mark.parametrize(("args", "needle"), [(["--bogus"], "unknown argument '--bogus'"),
                                              (["--updates", "3"], "--updates must be"),
                                              (["--gpus", "none"], "--gpus must be"),
                                              (["--gpus"], "--gpus needs a number")])
def test_bad_arguments_are_refused_by_name(args: list[str], needle: str) -> None:
    proc = run(*args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_refuses_before_doing_anything(tmp_path: Path) -> None:
    proc = run("--work", str(tmp_path / "work"))
    assert proc.returncode == 2
    assert "no CUDA GPU is visible to torch" in proc.stderr and "Nothing was run" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "work").exists()


def test_the_table_reads_what_the_steps_leave(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    records = [{"kind": "train", "update": u, "tokens_per_second": 1000.0 * u, "mfu": 0.001 * u}
               for u in range(10, 201, 10)] + [{"kind": "valid", "update": 100}]
    (tmp_path / "run/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "scores.json").write_text(json.dumps({"sacrebleu": {"score": 0.42}}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check_report.py"), str(tmp_path), "1",
                           "100", "200", "12.5", "300"], capture_output=True, text=True, check=True)
    past_warm_up = [u for u in range(120, 201, 10)]  # the resumed half, past its first 10 updates
    assert f"| {sum(past_warm_up) * 1000 / len(past_warm_up):,.0f} |" in proc.stdout
    assert f"| {sum(past_warm_up) * 0.001 / len(past_warm_up):.1%} |" in proc.stdout
    assert "| 0.42 |" in proc.stdout and "| 12.5 s |" in proc.stdout
