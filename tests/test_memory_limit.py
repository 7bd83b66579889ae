"""Every command, under a 1 GB address-space limit, meets inputs that once took the machine down and
answers with a clear error instead of a MemoryError (or of eating all memory where there is no limit).

The inputs: a YAML config whose value is a "billion laughs" (nine aliases nested nine deep: a few
lines that name 9^9 strings, whose repr is gigabytes), and text files without a line break: a link
to /dev/zero (endless) and a corrupt 20 MB file of NUL bytes (sparse on disk).

The limit: `import torch` alone reserves about 640 MB of address space on this machine (VmPeak; a
process that imports it under 600 MB fails), so 1 GB leaves the commands that import torch about
360 MB: ample for the clear error, far too little for the old behaviour (the repr of the billion
laughs, or a line of /dev/zero read until memory runs out).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_user_error, nmt, save_model_file

LIMIT_BYTES = 1 << 30
TOO_LONG = "line 1: longer than 16,777,216 bytes without a line break"


def billion_laughs(path: Path) -> Path:
    names = "abcdefghi"
    lines = ["src_lang:", f"  - &a [{', '.join(['lol'] * 9)}]"]
    lines += [f"  - &{name} [{', '.join([f'*{before}'] * 9)}]"
              for before, name in zip(names, names[1:], strict=False)]
    path.write_text("\n".join(lines) + "\n")
    return path


def limited(command: str) -> subprocess.CompletedProcess:
    """`nmt COMMAND` (`< FILE` at its end: with FILE as stdin) in a process whose address space is
    limited to LIMIT_BYTES."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    command, _, stdin = command.partition(" < ")
    with open(stdin or os.devnull, "rb") as source:
        return subprocess.run([sys.executable, "-m", "nmt_cli", *command.split()], stdin=source,
                              capture_output=True, text=True, timeout=120, preexec_fn=limit,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, toy_spm) -> dict[str, Path]:
    import torch

    from nmt_cli.config.model import ModelConfig
    from nmt_cli.model.transformer import Transformer

    folder = tmp_path_factory.mktemp("hostile_memory")
    paths = {"laughs": billion_laughs(folder / "laughs.yaml"), "zero": folder / "zero"}
    paths["zero"].symlink_to("/dev/zero")
    for name in ("nul_en", "nul_de"):
        paths[name] = folder / name.replace("_", ".")
        with open(paths[name], "wb") as f:
            f.truncate(20 << 20)
    paths["run"] = folder / "run"
    paths["run"].mkdir()
    os.link(paths["nul_en"], paths["run"] / "train.jsonl")
    nmt("prepare", "toy", "--out", folder / "raw", "--set", "toy_train=200")
    nmt("bpe", folder / "raw", "--out", folder / "bpe", "--vocab-size", 60)
    paths["bpe"] = folder / "bpe"
    torch.manual_seed(0)
    spm_bytes, dictionary = toy_spm
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, heads=2),
                        len(dictionary)).eval()
    paths["model"] = save_model_file(folder / "model.pt", model, dictionary, spm_bytes)
    paths["folder"] = folder
    return paths


# name: (the command line, with {input} for the paths above; what its error must say)
CASES = {
    "prepare_config_billion_laughs": ("prepare toy --config {laughs} --out {folder}/o1", "'src_lang' must "
                                      "be a string; got [['lol', 'lol', 'lol', 'lol', ...], [[...]"),
    "train_config_dev_zero": ("train {bpe} --config {zero} --save-dir {folder}/o2",
                              "a YAML config of over 1,048,576 bytes"),
    "prepare_local_corpus_of_nul_bytes": ("prepare local --src-lang en --tgt-lang de --train {folder}/nul "
                                          "--valid {folder}/nul --out {folder}/o3 --workers 1",
                                          f"nul.en, {TOO_LONG}"),
    "prepare_checksums_dev_zero": ("prepare wmt14-en-de --checksums {zero} --from {folder} --out {folder}/o4",
                                   "a checksums file of over 16,777,216 bytes"),
    "binarize_dictionary_dev_zero": ("binarize {bpe} --dictionary {zero} --out {folder}/o5 --workers 1",
                                     f"zero, {TOO_LONG}"),
    "translate_input_of_nul_bytes": ("translate {model} --input {nul_en} --output {folder}/o6.txt",
                                     f"nul.en, {TOO_LONG}"),
    "translate_stdin_dev_zero": ("translate {model} --output {folder}/o7.txt < {zero}",
                                 f"standard input, {TOO_LONG}"),
    "score_hypotheses_of_nul_bytes": ("score --hyp {nul_en} --ref {nul_de}", f"nul.en, {TOO_LONG}"),
    "plot_log_of_nul_bytes": ("plot {run} --out {folder}/o8.png", f"train.jsonl, {TOO_LONG}"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_command_gives_the_clear_error_within_1_gb(inputs: dict[str, Path], case: str) -> None:
    command, message = CASES[case]
    proc = limited(command.format(**inputs))
    assert_user_error(proc, message)
    assert "MemoryError" not in proc.stderr
