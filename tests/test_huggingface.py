"""`nmt export huggingface` and `nmt import huggingface` (issue 42): both ways exact.

- The renumbering of the residual stream that turns nmt's interleaved sinusoids into MarianMT's
  sin-then-cos ones changes no output (shown on nmt's own model, without transformers), and the
  renumbered table is MarianMT's.
- Export of the pipeline test's Multi30k model (conftest's `multi30k_run`): `MarianMTModel`'s logits
  are nmt's within 1e-4; `generate` greedy is `nmt translate --beam 1` and `generate` with the
  folder's defaults is `nmt translate --length-penalty fairseq --stop beam` on >= 99% of
  test_2016_flickr; the folder's `MarianTokenizer` gives nmt's ids.
- Import of a MarianMT built here in the OPUS-MT layout (random weights, sentencepiece models trained
  here, `</s>` first and `<pad>` last, no `<s>`, swish, separate source.spm and target.spm, a
  final_logits_bias): `nmt translate` is `generate` on every sentence, logits within 1e-4; export
  then import translates as the file did; it fine-tunes with `nmt train --init` on Multi30k split by
  its own two sentencepiece models.
- Refusals, both ways, each naming its setting; a hostile pytorch_model.bin runs nothing.

transformers limits a batch's output length where nmt limits each sentence's (a * |X| + b): the
search of a batch here is given the longest limit of its sentences, so only a line whose output
reaches its own limit could differ.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_user_error, nmt, toy_sentences
from nmt_cli.config.convert import HuggingfaceExportConfig, HuggingfaceImportConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.huggingface import layer_params, renumber, residual_permutation
from nmt_cli.model.transformer import Transformer, sinusoids

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'nmt-cli[huggingface]'")
pytest.importorskip("safetensors", reason="safetensors is not installed: pip install 'nmt-cli[huggingface]'")

from nmt_cli.inference import huggingface as export  # noqa: E402 (after the skip: it needs transformers)
from nmt_cli.model import huggingface as importer  # noqa: E402

BATCH = 50  # sentences a `generate` call


# -- the renumbering ------------------------------------------------------------------------------


def _small_config(**changes: object) -> ModelConfig:
    settings = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 16, "d_ff": 32, "heads": 4,
                "dropout": 0.0, "max_positions": 40}
    return ModelConfig(**{**settings, **changes})


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (3, 9), generator=g)
    src[:, -1], src[0, 6:] = EOS, PAD
    src[0, 5] = EOS
    prev = torch.cat([torch.full((3, 1), BOS), torch.randint(4, vocab, (3, 7), generator=g)], dim=1)
    return src, prev


def test_renumbering_the_residual_stream_changes_no_output() -> None:
    """Every weight that reads or writes the residual stream renumbered by PERM, and the position table
    with it: the same logits. The table alone, or the weights alone, changes them (the test can fail)."""
    cfg = _small_config(activation="swish", output_bias=True, share_embeddings="none")
    torch.manual_seed(0)
    model = Transformer(cfg, 30).eval()
    with torch.no_grad():
        for p in model.parameters():  # no zero biases or unit gains, whose renumbering shows nothing
            p.add_(0.1 * torch.randn_like(p))
    perm = residual_permutation(cfg.d_model)
    weights = dict(model.state_dict())
    for ours, _, how in layer_params(cfg):
        weights[ours] = renumber(weights[ours], how, perm)
    for table in ("embed.weight", "src_embed.weight", "output_proj.weight"):
        weights[table] = renumber(weights[table], "in", perm)
    renumbered = Transformer(cfg, 30).eval()
    renumbered.load_state_dict(weights)
    src, prev = _batch(30)
    with torch.no_grad():
        expected = model(src, prev)
        renumbered.positions = model.positions[:, perm]
        assert (renumbered(src, prev) - expected).abs().max() < 1e-5
        renumbered.positions = model.positions  # the weights renumbered, the table not
        assert (renumbered(src, prev) - expected).abs().max() > 1e-2


def test_the_renumbered_table_is_marians() -> None:
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for d_model in (16, 512):
        theirs = MarianSinusoidalPositionalEmbedding(100, d_model).create_weight()
        ours = sinusoids(100, d_model)[:, residual_permutation(d_model)]
        assert (ours - theirs).abs().max() < 1e-5


# -- export of the Multi30k model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(multi30k_run: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "marian"
    nmt("export", "huggingface", multi30k_run["model"], "--out", out)
    return out


@pytest.fixture(scope="module")
def marian(exported: Path):
    """(MarianMTModel, MarianTokenizer) of the exported folder."""
    model, info = transformers.MarianMTModel.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info  # no weight missing, unexpected or of another shape
    return model.eval(), transformers.MarianTokenizer.from_pretrained(exported)


@pytest.fixture(scope="module")
def test_lines(multi30k_run: dict[str, Path]) -> list[str]:
    """test_2016_flickr's English lines as `nmt translate` reads them: normalised as the model records."""
    loaded = model_file.load_text_model(multi30k_run["model"])
    lines = (multi30k_run["raw"] / "test.en").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1000
    return [loaded.normalization.apply(line) if loaded.normalization else line for line in lines]


def test_the_folder_is_what_transformers_loads(exported: Path, multi30k_run: dict[str, Path]) -> None:
    names = {"config.json", "model.safetensors", "generation_config.json", "source.spm", "target.spm",
             "vocab.json", "tokenizer_config.json", "README.md"}
    assert names <= {p.name for p in exported.iterdir()}
    card = (exported / "README.md").read_text(encoding="utf-8")
    assert "en -> de" in card and "`d_model` | `128`" in card and "updates" in card
    generation = json.loads((exported / "generation_config.json").read_text())
    search = (generation["num_beams"], generation["length_penalty"], generation["early_stopping"])
    assert search == (4, 0.6, True)
    assert generation["bad_words_ids"] == [[PAD], [BOS]]
    # a second export over the first is allowed; over a folder it did not write, refused
    nmt("export", "huggingface", multi30k_run["model"], "--out", exported)
    assert_user_error(nmt("export", "huggingface", multi30k_run["model"], "--out", multi30k_run["raw"],
                          check=False), "is not a folder `nmt export huggingface` wrote")


def test_the_tokenizer_gives_nmts_ids(marian, test_lines: list[str], multi30k_run: dict[str, Path]) -> None:
    import sentencepiece as spm

    _, tokenizer = marian
    loaded = model_file.load_text_model(multi30k_run["model"])
    sp = spm.SentencePieceProcessor(model_proto=loaded.spm_model)
    ours = [loaded.dictionary.encode(sp.encode(line, out_type=str)) + [EOS] for line in test_lines]
    assert tokenizer(test_lines)["input_ids"] == ours


def test_marian_logits_are_nmts(marian, test_lines: list[str], multi30k_run: dict[str, Path]) -> None:
    """Teacher-forced on the references: every logit of every real position within 1e-4."""
    import sentencepiece as spm

    model, tokenizer = marian
    loaded = model_file.load_text_model(multi30k_run["model"])
    sp = spm.SentencePieceProcessor(model_proto=loaded.spm_model)
    refs = (multi30k_run["raw"] / "test.de").read_text(encoding="utf-8").splitlines()[:64]
    batch = tokenizer(test_lines[:64], return_tensors="pt", padding=True)
    targets = [loaded.dictionary.encode(sp.encode(r, out_type=str)) for r in refs]
    prev = torch.full((64, max(map(len, targets)) + 1), PAD)
    for i, t in enumerate(targets):
        prev[i, : len(t) + 1] = torch.tensor([BOS, *t])
    with torch.no_grad():
        ours = loaded.model(batch["input_ids"], prev)
        start = prev.masked_fill(prev == BOS, model.config.decoder_start_token_id)
        theirs = model(**batch, decoder_input_ids=start, decoder_attention_mask=prev != PAD).logits
    real = prev != PAD
    difference = (ours - theirs).abs()[real].max().item()
    print(f"logits: max |nmt - transformers| = {difference:.2e} over {int(real.sum())} positions")
    assert difference < 1e-4


def generate_pieces(model, tokenizer, lines: list[str], **options: object) -> list[list[str]]:
    """The pieces `generate` gives each line, searched in batches of similar length, each batch with
    nmt's output-length limit (|X| + 50 pieces within the model's positions, then EOS) of its longest
    sentence; each output is then cut at its own sentence's limit, where nmt ends it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: more threads only wait on each other on shared cores
    try:
        return _generate_pieces(model, tokenizer, lines, **options)
    finally:
        torch.set_num_threads(threads)


def _generate_pieces(model, tokenizer, lines: list[str], **options: object) -> list[list[str]]:
    encoded = tokenizer(lines)["input_ids"]
    order = sorted(range(len(lines)), key=lambda i: len(encoded[i]))
    found: list[list[str]] = [[] for _ in lines]
    for start in range(0, len(order), BATCH):
        rows = order[start : start + BATCH]
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, return_tensors="pt")
        limits = {i: min(len(encoded[i]) - 1 + 50, model.config.max_position_embeddings - 1) for i in rows}
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max(limits.values()) + 1, **options)
        for i, ids in zip(rows, out.tolist(), strict=True):
            pieces = tokenizer.convert_ids_to_tokens(ids[1:])
            end = pieces.index(tokenizer.eos_token) if tokenizer.eos_token in pieces else len(pieces)
            # where nmt would have ended the sentence at its own limit (greedy: the same prefix)
            found[i] = [p for p in pieces[:end] if p not in (tokenizer.pad_token, "<s>")][: limits[i]]
    return found


def _nmt_pieces(model: Path, source: Path, out: Path, *options: object) -> list[list[str]]:
    """`nmt translate`'s pieces in fp32, as transformers computes: `--dtype auto` is bf16 on a CPU with
    native bf16, and a beam search in bf16 ranks near-equal hypotheses otherwise."""
    nmt("translate", model, "--input", source, "--output", out, "--output-format", "pieces",
        "--dtype", "fp32", *options)
    return [line.split() for line in out.read_text(encoding="utf-8").splitlines()]


def _same_share(ours: list[list[str]], theirs: list[list[str]]) -> float:
    assert len(ours) == len(theirs)
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


@pytest.mark.slow
def test_greedy_generate_is_nmt_translate_beam_1(marian, test_lines: list[str], multi30k_run: dict[str, Path],
                                                 tmp_path: Path) -> None:
    model, tokenizer = marian
    ours = _nmt_pieces(multi30k_run["model"], multi30k_run["raw"] / "test.en", tmp_path / "greedy",
                       "--beam", 1)
    theirs = generate_pieces(model, tokenizer, test_lines, num_beams=1, do_sample=False)
    same = _same_share(ours, theirs)
    print(f"greedy: identical on {same:.1%} of {len(ours)} lines")
    assert same >= 0.99


def test_decoded_with_skip_special_tokens_the_text_is_nmts(marian, test_lines: list[str]) -> None:
    """The model card's usage: batch_decode(..., skip_special_tokens=True) drops the decoder's first
    token (<s>) as it drops EOS and padding, and gives the text of the pieces."""
    model, tokenizer = marian
    batch = tokenizer(test_lines[:8], return_tensors="pt", padding=True)
    with torch.no_grad():
        found = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=40)
    texts = tokenizer.batch_decode(found, skip_special_tokens=True)
    pieces = [[p for p in tokenizer.convert_ids_to_tokens(row[1:]) if p not in ("</s>", "<pad>")]
              for row in found.tolist()]
    assert texts == ["".join(p).replace("\u2581", " ").strip() for p in pieces]
    assert not any("<s>" in text for text in texts)


@pytest.mark.slow
def test_generate_with_the_folders_defaults_is_nmt_fairseq_search(
        marian, test_lines: list[str], multi30k_run: dict[str, Path], tmp_path: Path) -> None:
    """generation_config.json's beam 4, alpha 0.6 and early stopping are `nmt translate
    --length-penalty fairseq --stop beam` (transformers divides by |Y| ** alpha and stops at `beam`
    finished hypotheses)."""
    model, tokenizer = marian
    ours = _nmt_pieces(multi30k_run["model"], multi30k_run["raw"] / "test.en", tmp_path / "beam",
                       "--length-penalty", "fairseq", "--stop", "beam")
    theirs = generate_pieces(model, tokenizer, test_lines)
    same = _same_share(ours, theirs)
    print(f"beam 4: identical on {same:.1%} of {len(ours)} lines")
    assert same >= 0.99


# -- import of an OPUS-MT-style folder ------------------------------------------------------------


def _spm(folder: Path, name: str, seed: int) -> Path:
    import sentencepiece as spm

    text = folder / f"{name}.txt"
    text.write_text("\n".join(toy_sentences(2000, seed=seed)) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / name), vocab_size=50,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   num_threads=1, minloglevel=2)
    return (folder / f"{name}.model").rename(folder / f"{name}.spm")


def _opus_folder(out: Path) -> Path:
    """A MarianMT folder as the OPUS-MT conversions write it: one vocab.json over two sentencepiece
    models, `</s>` first and `<pad>` last, no `<s>`, decoder start = pad, swish, a final_logits_bias."""
    import sentencepiece as spm

    out.mkdir(parents=True)
    pieces = []
    for name, seed in (("source", 0), ("target", 1)):
        sp = spm.SentencePieceProcessor(model_file=str(_spm(out, name, seed)))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                   if not (sp.is_control(i) or sp.is_unknown(i))]
    symbols = ["</s>", "<unk>", *dict.fromkeys(pieces), "<pad>"]
    (out / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}), encoding="utf-8")
    v = len(symbols)
    config = transformers.MarianConfig(
        vocab_size=v, decoder_vocab_size=v, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
        max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, pad_token_id=v - 1, eos_token_id=0,
        decoder_start_token_id=v - 1, forced_eos_token_id=0, dropout=0.1)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_()
    model.save_pretrained(out)
    transformers.MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"),
                                 str(out / "vocab.json")).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def opus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The OPUS-MT-style folder, imported through the command line, and toy source sentences."""
    work = tmp_path_factory.mktemp("opus")
    folder = _opus_folder(work / "opus")
    nmt("import", "huggingface", folder, "--out", work / "imported.pt", "--dict-out", work / "dict.txt")
    (work / "test.src").write_text("\n".join(toy_sentences(40, seed=7)) + "\n", encoding="utf-8")
    return {"folder": folder, "model": work / "imported.pt", "dict": work / "dict.txt",
            "src": work / "test.src"}


def test_the_imported_file_is_an_nmt_model(opus: dict[str, Path]) -> None:
    state = model_file.load(opus["model"])
    cfg = model_file.model_config_of(state, opus["model"])
    assert (cfg.activation, cfg.decoder_start, cfg.output_bias) == ("swish", "pad", True)
    assert state["spm_model"] == (opus["folder"] / "source.spm").read_bytes()
    assert state["target_spm_model"] == (opus["folder"] / "target.spm").read_bytes()
    symbols = state["dictionary"]["symbols"]
    assert symbols[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert Dictionary.load(opus["dict"]).symbols == symbols
    vocab = json.loads((opus["folder"] / "vocab.json").read_text())
    assert sorted(symbols) == sorted([*vocab, "<s>"])  # every MarianMT symbol, and nmt's <s>
    bos = state["model"]["embed.weight"][BOS]
    assert not bos.any() and state["model"]["output_bias"][BOS] == importer.NEVER


def _teacher_forced(marian_model, tokenizer, loaded: model_file.TextModel, lines: list[str],
                    outputs: torch.Tensor) -> float:
    """max |logit difference| on `generate`'s own outputs, MarianMT's ids mapped to nmt's by symbol."""
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    to_nmt = torch.tensor([loaded.dictionary.index[s] for s, _ in by_id])
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = marian_model(**batch, decoder_input_ids=outputs).logits
        prev = to_nmt[outputs]
        prev[:, 0] = BOS
        src = to_nmt[batch["input_ids"]]
        ours = loaded.model(src, prev)[:, :, to_nmt]
    real = torch.ones_like(outputs, dtype=torch.bool)
    real[:, 1:] = outputs[:, 1:] != marian_model.config.pad_token_id
    return (ours - theirs).abs()[real].max().item()


def test_nmt_translates_the_imported_model_as_generate(opus: dict[str, Path], tmp_path: Path) -> None:
    marian_model = transformers.MarianMTModel.from_pretrained(opus["folder"]).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(opus["folder"])
    lines = opus["src"].read_text(encoding="utf-8").splitlines()
    loaded = model_file.load_text_model(opus["model"])
    ours = _nmt_pieces(opus["model"], opus["src"], tmp_path / "greedy", "--beam", 1)
    theirs = generate_pieces(marian_model, tokenizer, lines, num_beams=1, do_sample=False)
    assert ours == theirs
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        outputs = marian_model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=20)
    difference = _teacher_forced(marian_model, tokenizer, loaded, lines, outputs)
    print(f"imported: max |nmt - transformers| logit = {difference:.2e}")
    assert difference < 1e-4


def test_a_pytorch_model_bin_imports_as_the_safetensors(opus: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    shutil.copytree(opus["folder"], folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    importer.run(HuggingfaceImportConfig(folder=folder, out=tmp_path / "bin.pt"))
    again, first = model_file.load(tmp_path / "bin.pt")["model"], model_file.load(opus["model"])["model"]
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_export_then_import_translates_as_the_file(opus: dict[str, Path], tmp_path: Path) -> None:
    export.run(HuggingfaceExportConfig(model=opus["model"], out=tmp_path / "again"))
    importer.run(HuggingfaceImportConfig(folder=tmp_path / "again", out=tmp_path / "again.pt"))
    beam = ("--beam", 4)
    assert (_nmt_pieces(tmp_path / "again.pt", opus["src"], tmp_path / "again.txt", *beam)
            == _nmt_pieces(opus["model"], opus["src"], tmp_path / "first.txt", *beam))
    state = model_file.load(tmp_path / "again.pt")
    assert state["target_spm_model"] == (opus["folder"] / "target.spm").read_bytes()


def _validation_loss(model_path: Path, data: Path) -> float:
    """The model's label-smoothed loss per target token on data's valid split."""
    from nmt_cli.config.train import TrainConfig
    from nmt_cli.data.dataset import collate
    from nmt_cli.training import corpus
    from nmt_cli.training.step import micro_batch_loss

    model, _, _ = model_file.load_model(model_path)
    # the pairs the model's positions hold, as training keeps them
    split = corpus.load(TrainConfig(data=data, save_dir=data.parent / "unused", model=model.cfg)).valid
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in split.batches:
            arrays = collate(split.src, split.tgt, ids)
            batch = {k: torch.from_numpy(v) for k, v in arrays.items() if k != "ids"}
            total += float(micro_batch_loss(model, batch, 0.1)[1])
            tokens += int((batch["target"] != PAD).sum())
    return total / tokens


@pytest.mark.slow
def test_fine_tuning_an_imported_model_lowers_its_validation_loss(opus: dict[str, Path], multi30k_raw: Path,
                                                                  tmp_path: Path) -> None:
    """As the README says: Multi30k split with the model's source.spm and target.spm, binarized with
    its dictionary, `nmt train --init` for a few updates; its checkpoints, and their average, keep the
    target.spm."""
    folder = opus["folder"]
    nmt("bpe", multi30k_raw, "--out", tmp_path / "bpe", "--model", folder / "source.spm",
        "--target-model", folder / "target.spm", "--workers", 2)
    nmt("binarize", tmp_path / "bpe", "--out", tmp_path / "bin", "--dictionary", opus["dict"], "--workers", 2)
    nmt("train", tmp_path / "bin", "--init", opus["model"], "--save-dir", tmp_path / "run", "--device", "cpu",
        "--precision", "fp32", "--max-update", 6, "--max-tokens", 2048, "--tokens-per-update", 2048,
        "--save-interval-minutes", 0, "--set", "optim.lr_schedule=inverse_sqrt", "--set", "optim.lr=1e-3",
        "--set", "optim.warmup_updates=1", "--set", "threads=1", "--set", "valid.interval_updates=1000",
        "--save-interval-updates", 3)
    nmt("average", tmp_path / "run", "--last", 2, "--out", tmp_path / "average.pt")
    last = tmp_path / "run" / "checkpoint_last.pt"
    for path in (last, tmp_path / "average.pt"):
        assert model_file.load(path)["target_spm_model"] == (folder / "target.spm").read_bytes()
    before = _validation_loss(opus["model"], tmp_path / "bin")
    after = _validation_loss(last, tmp_path / "bin")
    print(f"validation loss per token: imported {before:.4f}, after 6 updates {after:.4f}")
    assert after < before


def test_init_refuses_data_split_with_another_target_model(opus: dict[str, Path], tmp_path: Path) -> None:
    from nmt_cli.config.train import TrainConfig
    from nmt_cli.training import finetune
    from nmt_cli.training.corpus import Corpus

    state = model_file.load(opus["model"])
    dictionary = Dictionary(list(state["dictionary"]["symbols"]), list(state["dictionary"]["counts"]))
    data = Corpus(tmp_path, "en", "de", dictionary, bytes(state["spm_model"]), None, None, None)  # type: ignore
    model = Transformer(model_file.model_config_of(state, opus["model"]), len(dictionary))
    with pytest.raises(NmtError, match="target sentencepiece model .* --target-model"):
        cfg = TrainConfig(data=tmp_path, save_dir=tmp_path, init=opus["model"])
        finetune.load_init_weights(model, cfg, data)


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"norm": "pre"}, "model.norm='pre'"),
    ({"positions": "learned"}, "model.positions='learned'"),
    ({"positions": "fairseq_sinusoidal"}, "model.positions='fairseq_sinusoidal'"),
    ({"d_k": 8}, "model.d_k=8"),
    ({"output_vocab": 8}, "model.output_vocab=8"),
])
def test_export_refuses_what_marian_cannot_represent(changes: dict, message: str, toy_spm,
                                                     tmp_path: Path) -> None:
    from conftest import save_model_file

    spm_bytes, dictionary = toy_spm
    cfg = _small_config(**changes)
    path = save_model_file(tmp_path / "model.pt", Transformer(cfg, len(dictionary)), dictionary, spm_bytes)
    with pytest.raises(NmtError, match=f"MarianMT cannot represent .*{message.replace('(', '.')}"):
        export.run(HuggingfaceExportConfig(model=path, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_command_line_refuses_an_export_without_a_traceback(toy_spm, tmp_path: Path) -> None:
    from conftest import save_model_file

    spm_bytes, dictionary = toy_spm
    path = save_model_file(tmp_path / "model.pt", Transformer(_small_config(norm="pre"), len(dictionary)),
                           dictionary, spm_bytes)
    assert_user_error(nmt("export", "huggingface", path, "--out", tmp_path / "out", check=False),
                      "model.norm='pre'", "post-norm")


def _edited(opus: dict[str, Path], tmp_path: Path, config: dict | None = None,
            vocab: dict | None = None) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(opus["folder"], folder)
    for name, changes in (("config.json", config), ("vocab.json", vocab)):
        if changes:
            settings = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**settings, **changes}))
    return folder


@pytest.mark.parametrize(("config", "message"), [
    ({"activation_function": "gelu_new"}, "activation_function='gelu_new'"),
    ({"scale_embedding": False}, "scale_embedding=False"),
    ({"decoder_ffn_dim": 128}, "encoder_ffn_dim=64 with decoder_ffn_dim=128"),
    ({"decoder_layerdrop": 0.1}, "decoder_layerdrop=0.1"),
    ({"decoder_vocab_size": 30}, "decoder_vocab_size=30"),
    ({"decoder_start_token_id": 5}, "decoder_start_token_id=5"),
    ({"model_type": "bart"}, "model_type='bart'"),
])
def test_import_refuses_what_nmt_cannot_express(config: dict, message: str, opus: dict[str, Path],
                                                tmp_path: Path) -> None:
    folder = _edited(opus, tmp_path, config=config)
    with pytest.raises(NmtError, match=message.replace("(", ".")):
        importer.run(HuggingfaceImportConfig(folder=folder, out=tmp_path / "out.pt"))
    assert not (tmp_path / "out.pt").exists()


def test_import_refuses_a_multilingual_vocabulary_and_trained_positions(opus: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    vocab = json.loads((opus["folder"] / "vocab.json").read_text())
    code = {">>fr<<": next(s for s in vocab if s not in ("</s>", "<unk>", "<pad>"))}
    renamed = {(">>fr<<" if s == code[">>fr<<"] else s): i for s, i in vocab.items()}
    folder = _edited(opus, tmp_path)
    (folder / "vocab.json").write_text(json.dumps(renamed))
    with pytest.raises(NmtError, match="target-language codes"):
        importer.run(HuggingfaceImportConfig(folder=folder, out=tmp_path / "out.pt"))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    weights = load_file(folder / "model.safetensors")
    weights["model.decoder.embed_positions.weight"] = torch.randn(64, 32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NmtError, match="embed_positions.weight is not MarianMT's sinusoidal table"):
        importer.run(HuggingfaceImportConfig(folder=folder, out=tmp_path / "out.pt"))


@pytest.mark.parametrize("kind", ["zip", "raw"])
def test_a_hostile_pytorch_model_bin_runs_nothing(kind: str, opus: dict[str, Path], tmp_path: Path) -> None:
    """A pickle whose loading would create a file (tests/hostile.py's `_RunsCode`): refused, no file."""
    import pickle

    from hostile import _RunsCode

    folder = _edited(opus, tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    if kind == "zip":
        torch.save({"model.shared.weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    else:
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker)))
    proc = nmt("import", "huggingface", folder, "--out", tmp_path / "out.pt", check=False)
    assert_user_error(proc, "pytorch_model.bin")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_a_missing_extra_names_it(opus: dict[str, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("transformers", "safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    with pytest.raises(NmtError, match=r"pip install 'nmt-cli\[huggingface\]'"):
        export.run(HuggingfaceExportConfig(model=opus["model"], out=tmp_path / "out"))
    with pytest.raises(NmtError, match=r"pip install 'nmt-cli\[huggingface\]'"):
        importer.run(HuggingfaceImportConfig(folder=opus["folder"], out=tmp_path / "out.pt"))
