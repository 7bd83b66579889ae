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


# ---------------------------------------------------------------------------------------------
# The data pipeline on real text, once per test session


def make_prepare_folder(out: Path, splits: dict[str, tuple[str, str]], src_lang: str = "en",
                        tgt_lang: str = "de") -> Path:
    """A folder as `nmt prepare` writes it, holding exactly the given text.

    For tests of later stages that need text `nmt prepare` would clean away (empty lines, odd
    characters). `splits` maps a split name to the (source, target) file contents. Made with the
    real `StageOutput`, so its manifest has the layout the next stage reads.
    """
    from nmt_cli.artifacts import StageOutput, count_lines
    from nmt_cli.stages import PrepareConfig

    cfg = PrepareConfig(dataset="local", out=out, src_lang=src_lang, tgt_lang=tgt_lang, train="train",
                        valid="valid", test="test" if "test" in splits else None)
    with StageOutput(out, "prepare", cfg) as stage:
        for split, texts in splits.items():
            for lang, text in zip((src_lang, tgt_lang), texts, strict=True):
                (out / f"{split}.{lang}").write_text(text, encoding="utf-8", newline="")
                stage.add_output(f"{split}.{lang}")
        lines = {split: count_lines(out / f"{split}.{src_lang}") for split in splits}
        assert all(lines[s] == count_lines(out / f"{s}.{tgt_lang}") for s in splits)
        stage.info.update(src_lang=src_lang, tgt_lang=tgt_lang, splits={s: {"lines": n} for s, n in lines.items()})
    return out


MULTI30K_SPLITS = {"train": "train", "valid": "valid", "test": "test_2016_flickr"}


@pytest.fixture(scope="session")
def multi30k_raw(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`nmt prepare local` of Multi30k en-de (train, valid, test_2016_flickr), cleaned with the defaults."""
    folder = shared_data / "multi30k" / "en-de"
    out = tmp_path_factory.mktemp("multi30k") / "raw"
    nmt("prepare", "local", "--src-lang", "en", "--tgt-lang", "de", "--out", out,
        *(f"--{split}={folder / name}" for split, name in MULTI30K_SPLITS.items()))
    return out


@pytest.fixture(scope="session")
def multi30k_bpe(multi30k_raw: Path) -> Path:
    """`nmt bpe` of Multi30k with an 8000-piece model."""
    out = multi30k_raw.parent / "bpe"
    nmt("bpe", multi30k_raw, "--out", out, "--vocab-size", 8000, "--workers", 2)
    return out


@pytest.fixture(scope="session")
def multi30k_bin(multi30k_bpe: Path) -> Path:
    """`nmt binarize` of the Multi30k pieces."""
    out = multi30k_bpe.parent / "bin"
    nmt("binarize", multi30k_bpe, "--out", out, "--workers", 2)
    return out
