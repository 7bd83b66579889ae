"""Checkpoint and model files: damage is always caught, no file can run code, and a training folder
resumes from its newest intact checkpoint."""

from __future__ import annotations

import ast
import os
import pickle
import random
import threading
from pathlib import Path

import pytest
import torch

import nmt_cli
from conftest import assert_user_error, nmt, save_model_file
from nmt_cli import hooks
from nmt_cli.config.model import ModelConfig
from nmt_cli.errors import NmtError
from nmt_cli.model import file as file_format
from nmt_cli.model.transformer import Transformer
from nmt_cli.training import checkpoint
from nmt_cli.training.checkpoint import BEST, LAST

CFG = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, heads=2, dropout=0.0,
                  max_positions=32)


def _state(update: int) -> dict:
    """A training checkpoint as far as `load_latest` looks into it (the parts `load` checks are present)."""
    return {"kind": "checkpoint", "meta": {"update": update}, "train": {"update": update},
            "model": {"w": torch.full((256,), float(update))}, "model_config": {},
            "dictionary": {"symbols": [], "counts": []}, "spm_model": b"spm"}


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture
def model_file(tmp_path: Path, toy_spm) -> Path:
    spm_bytes, dictionary = toy_spm
    torch.manual_seed(0)
    return save_model_file(tmp_path / "model.pt", Transformer(CFG, len(dictionary)), dictionary, spm_bytes, 7)


def test_damage_anywhere_is_caught_and_named(model_file: Path, tmp_path: Path) -> None:
    """400 copies, each with one random bit flipped or cut short at a random length: each one either
    loads exactly the original contents (a flip in bytes nothing reads, such as the zip's padding) or
    is refused with an NmtError naming the file; never another exception, never different contents."""
    good, reference = model_file.read_bytes(), file_format.checksum(file_format.load(model_file))
    rng, damaged, refused = random.Random(7), tmp_path / "damaged.pt", 0
    for trial in range(400):
        data = bytearray(good)
        if trial % 4 == 0:
            data = data[: rng.randrange(len(data))]
        else:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        damaged.write_bytes(bytes(data))
        try:
            state = file_format.load(damaged)
        except NmtError as e:
            assert "damaged.pt" in str(e)
            refused += 1
            continue
        assert file_format.checksum(state) == reference, f"trial {trial}: damaged contents were loaded"
    assert refused > 300, "most damage must be caught"


def test_checkpoint_last_and_best_name_the_numbered_file_and_outlive_its_pruning(tmp_path: Path) -> None:
    checkpoint.save_training(tmp_path, 2, _state(2), best=True, keep_last=1)
    numbered = tmp_path / "checkpoint_2.pt"
    assert os.path.samefile(tmp_path / LAST, numbered), "written once, named twice"
    assert os.path.samefile(tmp_path / BEST, numbered)
    checkpoint.save_training(tmp_path, 4, _state(4), best=False, keep_last=1)
    assert not numbered.exists(), "keep_last=1 prunes checkpoint_2.pt"
    assert os.path.samefile(tmp_path / LAST, tmp_path / "checkpoint_4.pt")
    assert file_format.load(tmp_path / BEST)["train"]["update"] == 2, "the best file outlives its old name"
    checkpoint.save_training(tmp_path, 6, _state(6), best=False, keep_last=1, numbered=False)
    assert file_format.load(tmp_path / LAST)["train"]["update"] == 6, "a save for crash safety only"
    assert file_format.load(tmp_path / "checkpoint_4.pt")["train"]["update"] == 4, "replaced, not overwritten"
    assert checkpoint.numbered_checkpoints(tmp_path) == [(4, tmp_path / "checkpoint_4.pt")]


def _latest(save_dir: Path) -> tuple[str, int, list[str]]:
    path, state, problems = checkpoint.load_latest(save_dir)
    return path.name, state["train"]["update"], problems


def test_resume_takes_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    for update in (2, 4):
        checkpoint.save_training(tmp_path, update, _state(update), best=update == 2, keep_last=5)
    assert _latest(tmp_path) == (LAST, 4, [])

    # damage the file checkpoint_last.pt and checkpoint_4.pt both name: the numbered one before takes over
    _flip(tmp_path / LAST)
    name, update, problems = _latest(tmp_path)
    assert (name, update) == ("checkpoint_2.pt", 2), problems
    assert LAST in problems[0] and "checkpoint_4.pt" in problems[1] and "corrupt" in problems[1]
    _truncate(tmp_path / LAST)
    assert _latest(tmp_path)[:2] == ("checkpoint_2.pt", 2)

    # a crash after checkpoint_6.pt was written but before checkpoint_last.pt was replaced
    checkpoint.save_training(tmp_path, 4, _state(4), best=False, keep_last=5)
    file_format.save(tmp_path / "checkpoint_6.pt", _state(6))
    assert _latest(tmp_path) == ("checkpoint_6.pt", 6, [])
    _flip(tmp_path / "checkpoint_6.pt")
    name, update, problems = _latest(tmp_path)
    assert (name, update) == (LAST, 4) and "checkpoint_6.pt" in problems[0]

    for name in (LAST, "checkpoint_4.pt", "checkpoint_6.pt"):
        (tmp_path / name).unlink()
    (tmp_path / "checkpoint_2.pt").unlink()  # only checkpoint_best.pt (update 2) is left
    assert _latest(tmp_path)[:2] == (BEST, 2)
    _flip(tmp_path / BEST)
    with pytest.raises(NmtError, match=f"holds checkpoints but none can be resumed.*{BEST}"):
        checkpoint.load_latest(tmp_path)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint.load_latest(empty) is None
    # even an empty file is a checkpoint that must not be ignored
    (empty / "checkpoint_3.pt").write_bytes(b"")
    with pytest.raises(NmtError, match="checkpoint_3.pt"):
        checkpoint.load_latest(empty)


def test_relinking_best_after_a_crash(tmp_path: Path) -> None:
    checkpoint.save_training(tmp_path, 2, _state(2), best=True, keep_last=5)
    # the crash came before checkpoint_best.pt moved
    file_format.save(tmp_path / "checkpoint_4.pt", _state(4))
    checkpoint.relink_best(tmp_path, 4)
    assert os.path.samefile(tmp_path / BEST, tmp_path / "checkpoint_4.pt")


def test_a_background_save_writes_the_state_of_its_submit_while_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit` returns with the write still to come; what training changes after it (tensors in
    place, containers) is not what is written; "saved" is said once the files are in place."""
    writing, release = threading.Event(), threading.Event()

    def held_save(path: Path, state: dict) -> None:
        writing.set()
        assert release.wait(timeout=60)
        file_format.save(path, state)

    monkeypatch.setattr(checkpoint, "save", held_save)
    said: list[str] = []
    state = _state(2)
    state["train"]["optimizer"] = {"state": {0: {"exp_avg": torch.ones(8)}}, "param_groups": [{"lr": 1.0}]}
    with checkpoint.Saver(said.append, said.append) as saver:
        saver.submit(tmp_path, 2, state, best=True, keep_last=5)
        assert writing.wait(timeout=60) and not list(tmp_path.glob("checkpoint*.pt")) and said == []
        state["model"]["w"].add_(1.0)  # the next update
        state["train"]["optimizer"]["state"][0]["exp_avg"].mul_(0.5)
        state["train"]["optimizer"]["param_groups"][0]["lr"] = 2.0
        state["train"]["update"] = 3
        release.set()
    assert said == [f"saved {tmp_path / 'checkpoint_2.pt'} (best so far)"]
    written = file_format.load(tmp_path / LAST)
    assert torch.equal(written["model"]["w"], torch.full((256,), 2.0))
    assert torch.equal(written["train"]["optimizer"]["state"][0]["exp_avg"], torch.ones(8))
    assert written["train"]["optimizer"]["param_groups"][0]["lr"] == 1.0 and written["train"]["update"] == 2
    assert os.path.samefile(tmp_path / LAST, tmp_path / "checkpoint_2.pt")
    assert os.path.samefile(tmp_path / BEST, tmp_path / "checkpoint_2.pt")


def test_an_error_of_the_background_write_is_raised_in_the_training_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the kind of error it was, by the next `wait` or `submit`, once; an error the run already
    ends with is not replaced by it."""
    def at(point: str, **details: object) -> None:
        if point == "checkpoint_saved":
            raise NmtError("no space left for checkpoint_last.pt")

    monkeypatch.setattr(hooks, "at", at)
    said: list[str] = []
    saver = checkpoint.Saver(said.append, said.append)
    saver.submit(tmp_path, 2, _state(2), best=False, keep_last=5)
    with pytest.raises(NmtError, match="no space left"):
        saver.wait()
    saver.wait()
    saver.submit(tmp_path, 4, _state(4), best=False, keep_last=5)
    with pytest.raises(NmtError, match="no space left"):
        saver.submit(tmp_path, 6, _state(6), best=False, keep_last=5)
    assert said == [] and not (tmp_path / "checkpoint_6.pt").exists()

    with pytest.raises(KeyError, match="the run's own"), saver:
        saver.submit(tmp_path, 8, _state(8), best=False, keep_last=5)
        raise KeyError("the run's own error")
    assert len(said) == 1 and "checkpoint being written" in said[0] and "no space left" in said[0]

    (tmp_path / "a_file").write_text("")
    saver.submit(tmp_path / "a_file", 10, _state(10), best=False, keep_last=5)
    with pytest.raises(OSError):
        saver.wait()


def test_interrupted_writes_are_cleaned_up(tmp_path: Path) -> None:
    names = [".checkpoint_4.pt.abc.tmp", ".checkpoint_last.pt.123.tmp", ".train.jsonl.x1.tmp",
             ".config.yaml.y.tmp"]
    for name in [*names, "notes.tmp", ".other.tmp"]:
        (tmp_path / name).write_text("x")
    assert sorted(p.name for p in checkpoint.remove_temporaries(tmp_path)) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp", "notes.tmp"]


# ---------------------------------------------------------------------------------------------
# No file runs code


_UNSAFE_CALLS = {"pickle.load", "pickle.loads", "torch.jit.load", "marshal.load", "marshal.loads",
                 "yaml.load", "yaml.unsafe_load", "yaml.full_load", "dill.load", "joblib.load",
                 "torch.serialization.load"}


def test_every_torch_load_in_the_package_is_weights_only() -> None:
    """Scans the source: every torch.load passes weights_only=True, and nothing else unpickles."""
    found = []
    for path in sorted(Path(nmt_cli.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "torch", "marshal", "dill"):
                assert all(a.name not in ("load", "loads") for a in node.names), \
                    f"{path.name}: imports a loader"
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            where = f"{path.name}:{node.lineno}"
            assert name not in _UNSAFE_CALLS, f"{where}: {name} can run code from a file"
            if name in ("np.load", "numpy.load"):
                assert not any(k.arg == "allow_pickle" for k in node.keywords), \
                    f"{where}: np.load with pickles"
            if name == "torch.load":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                # The one exception: the fairseq importer unpickles through its allow-list Unpickler
                # (test_fairseq_variants proves a hostile file runs nothing there).
                restricted = (path.name == "fairseq_pickle.py"
                              and keywords.get("pickle_module") == "_PickleModule")
                assert keywords.get("weights_only") == "True" or restricted, where
                found.append(where)
    assert found, "the scan should see file_format.load's torch.load"


class _RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _hostile_files(folder: Path, marker: Path) -> dict[str, Path]:
    """Files that run code when loaded without weights_only: a torch.save zip in the nmt layout with
    the payload among its weights, and a bare pickle (torch.load's legacy format)."""
    folder.mkdir(parents=True, exist_ok=True)
    zipped, bare = folder / "zipped.pt", folder / "bare.pt"
    torch.save({"format": file_format.FORMAT, "kind": "checkpoint", "train": {"update": 5},
                "model": {"w": _RunsCode(marker)}}, zipped)
    with open(bare, "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    return {"zipped": zipped, "bare": bare}


def test_the_payload_is_live(tmp_path: Path) -> None:
    """The control: an unsafe load of the hostile file does run its code (so the tests below can fail)."""
    marker = tmp_path / "ran"
    torch.load(_hostile_files(tmp_path, marker)["zipped"], weights_only=False)
    assert marker.exists()


def test_loading_never_runs_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # a user's environment cannot turn it off
    for path in _hostile_files(tmp_path, marker).values():
        with pytest.raises(NmtError, match=path.name):
            file_format.load(path)
    assert not marker.exists()


@pytest.mark.slow
def test_train_average_and_translate_refuse_code(tmp_path: Path, train_data: Path) -> None:
    """Through the command line, with torch's environment switch for unsafe loading set."""
    marker = tmp_path / "ran"
    files = _hostile_files(tmp_path / "hostile", marker)
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    for path in files.values():
        assert_user_error(nmt("translate", path, input="a b\n", check=False, env=env), path.name)
    assert_user_error(nmt("average", *files.values(), "--out", tmp_path / "avg.pt", check=False, env=env),
                      "zipped.pt")
    save = tmp_path / "run"
    save.mkdir()
    os.link(files["zipped"], save / LAST)
    os.link(files["bare"], save / "checkpoint_5.pt")
    refused = nmt("train", train_data, "--save-dir", save, "--arch", "transformer_tiny", check=False, env=env)
    assert_user_error(refused, "none can be resumed", LAST, "checkpoint_5.pt")
    assert not marker.exists()


@pytest.mark.slow
def test_average_and_translate_refuse_damaged_files_by_name(tmp_path: Path, toy_spm) -> None:
    spm_bytes, dictionary = toy_spm
    paths = []
    for update in (1, 2, 3):
        torch.manual_seed(update)
        paths.append(save_model_file(tmp_path / f"checkpoint_{update}.pt", Transformer(CFG, len(dictionary)),
                                     dictionary, spm_bytes, update, kind="checkpoint"))
    _flip(paths[1])
    _truncate(paths[2])
    out = tmp_path / "avg.pt"
    assert_user_error(nmt("average", tmp_path, "--last", 3, "--out", out, check=False),
                      "checkpoint_2.pt", "corrupt")
    assert_user_error(nmt("average", paths[0], paths[2], "--out", out, check=False),
                      "checkpoint_3.pt", "truncated")
    assert not out.exists()
    assert_user_error(nmt("translate", paths[1], input="a\n", check=False), "checkpoint_2.pt", "corrupt")
    assert_user_error(nmt("translate", paths[2], input="a\n", check=False), "checkpoint_3.pt", "truncated")
