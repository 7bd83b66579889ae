"""Fixtures shared by the test modules.

Real text lives in ``../shared/data`` beside the repository (or where ``NMT_SHARED_DATA`` points).
Tests that need it are skipped, with the reason, when it is absent (a user's fresh clone).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real parallel text; skips the test when it is not there."""
    if not (SHARED_DATA / "multi30k").is_dir():
        pytest.skip(f"real test data not found at {SHARED_DATA} (set NMT_SHARED_DATA to the shared/data folder)")
    return SHARED_DATA


def nmt(*args: object, check: bool = True, input: str | bytes | None = None, timeout: float = 1200,
        env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real `nmt` command line in a fresh Python process, as a user would."""
    text = not isinstance(input, bytes)
    proc = subprocess.run(
        [sys.executable, "-m", "nmt_cli", *map(str, args)],
        input=input, capture_output=True, text=text, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"nmt {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A clear failure: non-zero exit, one message naming the problem, no Python traceback."""
    output = proc.stdout + proc.stderr if isinstance(proc.stdout, str) else (proc.stdout + proc.stderr).decode()
    assert proc.returncode != 0, f"expected failure, got success:\n{output}"
    assert "Traceback" not in output, f"traceback shown to the user:\n{output}"
    for needle in needles:
        assert needle in output, f"{needle!r} not in:\n{output}"
