"""Fixtures shared by the test modules.

Real text lives in ``../shared/data`` beside the repository (or where ``NMT_SHARED_DATA`` points).
Tests that need it are skipped, with the reason, when it is absent (a user's fresh clone).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))
# The tests' side of nmt_cli.hooks, in this process and every one it starts (fault_hooks.py): each
# hook acts only when a test sets its own variable (NMT_TEST_FAULTS, ...).
os.environ["NMT_TEST_HOOKS"] = str(Path(__file__).with_name("fault_hooks.py"))


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Inductor's cache for this test session, in this process and every one it starts: empty at
    first, so each compiled model compiles for real, never from a user's cache (`~/.cache`, `/tmp`);
    what a later compile shares with an earlier one (the same graphs, in worker processes) it finds."""
    folder = tmp_path_factory.mktemp("inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real parallel text; skips the test when it is not there."""
    if not (SHARED_DATA / "multi30k").is_dir():
        pytest.skip(f"real test data not found at {SHARED_DATA} "
                    "(set NMT_SHARED_DATA to the shared/data folder)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ptb_sample() -> Path:
    """The 99 files of the Penn Treebank sample (wsj_0001 .. wsj_0099); skips the test when absent."""
    folder = SHARED_DATA / "ptb-sample"
    if not (folder / "wsj_0099.mrg").is_file():
        pytest.skip(f"the Penn Treebank sample is not at {folder} (set NMT_SHARED_DATA to the shared/data "
                    "folder)")
    return folder


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
        raise AssertionError(f"nmt {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A clear failure: non-zero exit, one message naming the problem, no Python traceback."""
    output = (proc.stdout + proc.stderr if isinstance(proc.stdout, str)
              else (proc.stdout + proc.stderr).decode())
    assert proc.returncode != 0, f"expected failure, got success:\n{output}"
    assert "Traceback" not in output, f"traceback shown to the user:\n{output}"
    for needle in needles:
        assert needle in output, f"{needle!r} not in:\n{output}"


# ---------------------------------------------------------------------------------------------
# Training on the CPU in seconds (test_train, test_resume, test_guard)

# A model small enough to train a few updates a second, in fp32 so that runs repeat bit for bit.
TINY_TRAIN = ["--arch", "transformer_tiny", "--precision", "fp32", "--max-tokens", "256",
              "--save-interval-minutes", "0", "--set", "model.d_model=32", "--set", "model.d_ff=64",
              "--set", "model.heads=2", "--set", "threads=1", "--set", "log.interval=1"]


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic binarized folder (tests/synthetic_binarized.py): 150 short training pairs plus two
    too long for max_tokens=256 (ids 150, 151), 30 valid pairs."""
    from synthetic_binarized import build

    return build(tmp_path_factory.mktemp("train") / "bin", train=150, valid=30, long_examples=2)


def tiny_trainer(train_data: Path, save_dir: Path, **changes: object):
    """A `train.Trainer` of a 2-layer, 32-wide model on `train_data`, in this process (fp32, no log
    output); `changes` replace fields of its TrainConfig."""
    import dataclasses

    import torch

    from nmt_cli.config.model import ModelConfig
    from nmt_cli.config.train import BatchConfig, GuardConfig, OptimConfig, train_base
    from nmt_cli.training import corpus, distributed, train
    from nmt_cli.training.trainlog import TrainLog

    cfg = dataclasses.replace(train_base("transformer_tiny"), data=train_data, save_dir=save_dir,
                              precision="fp32", batch=BatchConfig(max_tokens=256),
                              guard=GuardConfig(max_oom_fraction=1.0),
                              optim=OptimConfig(lr_schedule="inverse_sqrt", lr=1e-3, warmup_updates=0),
                              model=ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64,
                                                heads=2, dropout=0.0))
    cfg = dataclasses.replace(cfg, **changes)
    return train.Trainer(cfg, distributed.Context(0, 1, 0, torch.device("cpu")), corpus.load(cfg),
                         TrainLog(save_dir, enabled=False))


def train_records(save_dir: Path, kind: str = "train") -> list[dict]:
    """The records of one kind in SAVE_DIR/train.jsonl."""
    import json

    lines = (save_dir / "train.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


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
    from nmt_cli.config.data import PrepareConfig

    cfg = PrepareConfig(dataset="local", out=out, src_lang=src_lang, tgt_lang=tgt_lang, train="train",
                        valid="valid", test="test" if "test" in splits else None)
    with StageOutput(out, "prepare", cfg) as stage:
        for split, texts in splits.items():
            for lang, text in zip((src_lang, tgt_lang), texts, strict=True):
                (out / f"{split}.{lang}").write_text(text, encoding="utf-8", newline="")
                stage.add_output(f"{split}.{lang}")
        lines = {split: count_lines(out / f"{split}.{src_lang}") for split in splits}
        assert all(lines[s] == count_lines(out / f"{s}.{tgt_lang}") for s in splits)
        stage.info.update(src_lang=src_lang, tgt_lang=tgt_lang,
                          splits={s: {"lines": n} for s, n in lines.items()})
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


def bpe_input_lines(raw: Path, split: str, lang: str) -> list[str]:
    """The lines of `raw` (a prepare folder) as `nmt bpe` encodes them: the source side of valid and
    test normalised as prepare normalised train's (the manifest's record), the rest as they are."""
    import json

    from nmt_cli.artifacts import read_lines
    from nmt_cli.data.clean import Normalization

    manifest = json.loads((raw / "manifest.json").read_text())
    lines = list(read_lines(raw / f"{split}.{lang}"))
    normalization = Normalization.from_record(manifest.get("source_normalization"), "manifest", "")
    if normalization is None or lang != manifest["src_lang"] or split == "train":
        return lines
    return [normalization.apply(line) for line in lines]


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


# A tiny Transformer for a few minutes of CPU: 4000 target tokens per update, the paper's schedule
# with a warm-up scaled to the run. In fp32, so its time does not hang on how fast a CI machine's bf16
# is (one that listed AVX512-BF16 ran this in bf16 at a third of this machine's speed).
MULTI30K_TRAIN = ["--arch", "transformer_tiny", "--precision", "fp32", "--max-update", "400",
                  "--tokens-per-update", "4000", "--max-tokens", "4000", "--save-interval-minutes", "0",
                  "--save-interval-updates", "100", "--keep-last", "3", "--set", "optim.warmup_updates=250",
                  "--set", "valid.interval_updates=100", "--set", "log.interval=50", "--valid-bleu",
                  "--set", "valid.bleu_sentences=200", "--device", "cpu"]


@pytest.fixture(scope="session")
def multi30k_run(multi30k_bin: Path) -> dict[str, Path]:
    """The whole pipeline on Multi30k: train, average the last 3 checkpoints, translate and score the test
    set (test_pipeline.py checks each stage; the server and export tests reuse its model)."""
    work = multi30k_bin.parent
    save = work / "checkpoints"
    nmt("train", multi30k_bin, "--save-dir", save, *MULTI30K_TRAIN)
    nmt("average", save, "--last", "3", "--out", work / "model.pt")
    nmt("translate", work / "model.pt", "--input", work / "raw" / "test.en", "--output", work / "test.hyp.de")
    nmt("score", "--hyp", work / "test.hyp.de", "--ref", work / "raw" / "test.de", "--langpair", "en-de",
        "--json", work / "scores.json")
    return {"save": save, "model": work / "model.pt", "hyp": work / "test.hyp.de", "raw": work / "raw",
            "scores": work / "scores.json"}


@pytest.fixture(scope="session")
def multi30k_fp32_hyp(multi30k_run: dict[str, Path]) -> Path:
    """`nmt translate --dtype fp32` of Multi30k's test set: the reference of the servers, which run in
    fp32 because only there is a line's translation independent of its batch (in bf16 the matrix
    products round with the number of rows: `nmt translate` itself then changes a near-tie when its
    batches change)."""
    hyp = multi30k_run["hyp"].with_name("test.fp32.hyp.de")
    nmt("translate", multi30k_run["model"], "--dtype", "fp32", "--input", multi30k_run["raw"] / "test.en",
        "--output", hyp)
    return hyp


# ---------------------------------------------------------------------------------------------
# Model files for the inference tests (average, translate, search): small models made in-process in
# seconds, for properties of the search that need a model emitting EOS sensibly. The real `nmt train`
# output goes through average/translate/score in test_pipeline.py.

TOY_WORDS = ["red", "green", "blue", "black", "white", "small", "large", "old", "new", "fast", "slow",
             "cat", "dog", "bird", "fish", "house", "tree", "river", "stone", "cloud", "sings", "runs",
             "sleeps", "eats", "sees", "the", "a", "and", "of", "under", "near"]


def toy_sentences(count: int, seed: int, max_words: int = 10) -> list[str]:
    """Random sentences over a small vocabulary, 1 to `max_words` words each."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(count)]


@pytest.fixture(scope="session")
def toy_spm(tmp_path_factory: pytest.TempPathFactory):
    """(sentencepiece model bytes, Dictionary) trained on toy sentences: a real, tiny BPE model."""
    import sentencepiece as spm

    from nmt_cli.data.dataset import Dictionary

    folder = tmp_path_factory.mktemp("toy_spm")
    text = folder / "text.txt"
    text.write_text("\n".join(toy_sentences(3000, seed=0)) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "spm"), vocab_size=80,
                                   model_type="bpe", character_coverage=1.0, pad_id=-1, bos_id=-1, eos_id=-1,
                                   unk_id=0, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    model_bytes = (folder / "spm.model").read_bytes()
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    from collections import Counter

    counts = Counter(p for line in text.read_text(encoding="utf-8").splitlines()
                     for p in sp.encode(line, out_type=str))
    return model_bytes, Dictionary.from_counts(counts)


def save_model_file(path: Path, model, dictionary, spm_bytes: bytes, update: int = 0,
                    kind: str = "model") -> Path:
    """Write `model` as `nmt train` / `nmt average` would (the training state left out)."""
    from nmt_cli.model import file as model_file

    model_file.save(path, {"kind": kind, "meta": {"update": update},
                           **model_file.model_state(model, model.cfg, dictionary, spm_bytes)})
    return path


@pytest.fixture(scope="session")
def tiny_trained_model(tmp_path_factory: pytest.TempPathFactory, toy_spm) -> Path:
    """A model file of a 2+2-layer Transformer trained for a few seconds to copy toy sentences, so
    that it emits EOS at sensible places."""
    import sentencepiece as spm
    import torch
    import torch.nn.functional as F

    from nmt_cli.config.model import ModelConfig
    from nmt_cli.data.dataset import BOS, EOS, PAD
    from nmt_cli.model.transformer import Transformer

    spm_bytes, dictionary = toy_spm
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    torch.manual_seed(0)
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=64, d_ff=128, heads=4, dropout=0.0,
                      max_positions=64)
    model = Transformer(cfg, len(dictionary))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    data = [dictionary.encode(sp.encode(s, out_type=str)) for s in toy_sentences(4000, seed=1)]
    for step in range(300):
        batch = data[(step * 64) % len(data):][:64]
        width = max(map(len, batch)) + 1
        src = torch.full((len(batch), width), PAD)
        prev = torch.full((len(batch), width), PAD)
        for i, ids in enumerate(batch):
            src[i, : len(ids) + 1] = torch.tensor([*ids, EOS])
            prev[i, : len(ids) + 1] = torch.tensor([BOS, *ids])
        loss = F.cross_entropy(model(src, prev).transpose(1, 2), src, ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_model_file(tmp_path_factory.mktemp("trained") / "model.pt", model.eval(), dictionary,
                           spm_bytes, 300)


@functools.cache
def why_torch_compile_cannot_run() -> str | None:
    """None where torch.compile works on this machine's CPU (it needs a C++ compiler and headers),
    else why not: the compiled-decoder tests then skip, as a user's `--compile` would fail clearly."""
    from nmt_cli.model.cpu import missing_compiler

    if (compiler := missing_compiler()) is not None:
        return f"torch.compile on the CPU needs a C++ compiler ({compiler}); none found"
    probe = "import torch; print(torch.compile(lambda x: x.sin() + 1)(torch.ones(3)).sum().item())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    return (None if proc.returncode == 0
            else f"torch.compile fails here: {(proc.stderr.strip().splitlines() or [''])[-1]}")


# ---------------------------------------------------------------------------------------------
# Two fairseq checkpoints (../shared/data/fairseq-model), imported once per session

FAIRSEQ_MODELS = ("transformer", "prenorm")


@pytest.fixture(scope="session")
def fairseq_models(shared_data: Path) -> Path:
    folder = shared_data / "fairseq-model"
    if not (folder / "transformer" / "checkpoint_best.pt").is_file():
        pytest.skip(f"fairseq checkpoints not found at {folder} (see its README)")
    return folder


@pytest.fixture(scope="session")
def imported(fairseq_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fairseq checkpoint imported once, through the command line."""
    out = tmp_path_factory.mktemp("imported")
    for name in FAIRSEQ_MODELS:
        nmt("import", "fairseq", fairseq_models / name / "checkpoint_best.pt", "--out", out / f"{name}.pt")
    return {name: out / f"{name}.pt" for name in FAIRSEQ_MODELS}
