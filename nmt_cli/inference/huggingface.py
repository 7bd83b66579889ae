"""`nmt export huggingface MODEL --out DIR`: a model file as a MarianMT folder, what
`transformers.MarianMTModel.from_pretrained(DIR)` and `MarianTokenizer.from_pretrained(DIR)` load as
they load an OPUS-MT model, and what a user would upload to the Hugging Face Hub.

The weights go through `model.huggingface`'s correspondence (the residual stream renumbered so that
MarianMT's sin-then-cos position table is nmt's interleaved one; why that is exact is said there).
The vocabulary keeps nmt's ids (`<pad> <s> </s> <unk>` at 0-3), so the tokenizer's ids are nmt's.
The position tables are written too, though MarianMT rebuilds its own: what loads is the table nmt
computes. `generation_config.json` holds nmt's translation defaults as transformers can search them:
beam 4 and the length penalty's alpha 0.6, with transformers' own length penalty |Y|^alpha and its
`early_stopping=True` (stop once `beam` hypotheses have finished), which are nmt's
`--length-penalty fairseq --stop beam`; PAD and BOS are never produced (`bad_words_ids`), as nmt's
search masks them. transformers' length limit is one per batch where nmt's is a * |X| + b per
sentence. The folder is written to a temporary folder beside DIR and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli import __version__
from nmt_cli.config.convert import HuggingfaceExportConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD, UNK, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.huggingface import layer_params, renumber, residual_permutation
from nmt_cli.model.transformer import Transformer

FORMAT = "nmt-huggingface/1"  # config.json's `nmt_export`: a folder this command may overwrite
MISSING = ("the transformers and safetensors packages are not installed: pip install 'nmt-cli[huggingface]' "
           "(or pip install transformers safetensors)")
BEAM, ALPHA = 4, 0.6  # nmt translate's defaults


def _libraries() -> tuple[Any, Any]:
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError:
        raise NmtError(MISSING) from None
    return transformers, save_file


def unsupported(cfg: ModelConfig) -> list[str]:
    """The settings of `cfg` MarianMT cannot represent, each named with what it has instead."""
    d_k, d_v = cfg.head_widths
    problems = [f"model.{name}={value!r} ({instead})" for name, value, ok, instead in (
        ("norm", cfg.norm, cfg.norm == "post", "MarianMT's layers are post-norm"),
        ("positions", cfg.positions, cfg.positions == "sinusoidal",
         "MarianMT has the paper's sinusoids only"),
        ("output_vocab", cfg.output_vocab, cfg.output_vocab == 0,
         "MarianMT's decoder scores the vocabulary it reads"),
    ) if not ok]
    if d_k * cfg.heads != cfg.d_model or d_v * cfg.heads != cfg.d_model:
        problems.append(f"model.d_k={cfg.d_k}, model.d_v={cfg.d_v} (MarianMT's heads are d_model / h wide)")
    return problems


def marian_weights(model: Transformer) -> dict[str, Tensor]:
    """MarianMTModel's state dict (names as `save_pretrained` writes them, the position tables too)
    holding `model`'s weights."""
    cfg, w = model.cfg, model.state_dict()
    perm = residual_permutation(cfg.d_model)
    tables = {"all": {"model.shared.weight": "embed.weight"},
              "target": {"model.encoder.embed_tokens.weight": "src_embed.weight",
                         "model.decoder.embed_tokens.weight": "embed.weight"},
              "none": {"model.encoder.embed_tokens.weight": "src_embed.weight",
                       "model.decoder.embed_tokens.weight": "embed.weight",
                       "lm_head.weight": "output_proj.weight"},
              }[cfg.share_embeddings]
    out = {theirs: renumber(w[ours], "in", perm) for theirs, ours in tables.items()}
    bias = w["output_bias"] if cfg.output_bias else torch.zeros(model.output_vocab)
    out["final_logits_bias"] = bias.reshape(1, -1)
    positions = model.positions[:, perm]
    for side in ("encoder", "decoder"):
        out[f"model.{side}.embed_positions.weight"] = positions.clone()
    for ours, theirs, how in layer_params(cfg):
        value = renumber(w[ours], how, perm)
        if ".q_proj." in theirs:  # nmt's stacked W^Q, W^K, W^V, each d_model rows
            for name, part in zip("qkv", value.split(cfg.d_model), strict=True):
                out[theirs.replace(".q_proj.", f".{name}_proj.")] = part
        else:
            out[theirs] = value
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def marian_config(transformers: Any, cfg: ModelConfig, vocab_size: int) -> Any:
    start = {"bos": BOS, "eos": EOS, "pad": PAD}[cfg.decoder_start]
    return transformers.MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, max_position_embeddings=cfg.max_positions,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers, d_model=cfg.d_model,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads, activation_function=cfg.activation, dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        scale_embedding=True, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        decoder_start_token_id=start, forced_eos_token_id=EOS,
        share_encoder_decoder_embeddings=cfg.share_embeddings == "all",
        tie_word_embeddings=cfg.share_embeddings != "none", architectures=["MarianMTModel"],
        nmt_export=FORMAT)


def generation_config(transformers: Any, cfg: ModelConfig) -> Any:
    """nmt's translation defaults as transformers searches (see the module docstring)."""
    start = {"bos": BOS, "eos": EOS, "pad": PAD}[cfg.decoder_start]
    return transformers.GenerationConfig(
        num_beams=BEAM, length_penalty=ALPHA, early_stopping=True, max_length=cfg.max_positions + 1,
        bad_words_ids=[[PAD], [BOS]], decoder_start_token_id=start, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=BOS, forced_eos_token_id=EOS)


def run(cfg: HuggingfaceExportConfig) -> None:
    transformers, save_file = _libraries()
    path, out = Path(cfg.model), Path(cfg.out)
    state = model_file.load(path)
    loaded = model_file.load_text_model(path)
    problems = unsupported(loaded.model.cfg)
    if problems:
        raise NmtError(f"{path}: MarianMT cannot represent {'; '.join(problems)}")
    if out.exists() and not _exported_here(out):
        raise NmtError(f"{out} exists and is not a folder `nmt export huggingface` wrote: give another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # beside DIR: one disk, one rename
    try:
        write_folder(transformers, save_file, tmp, loaded, state, path)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {path} -> {out} (MarianMT: load it with transformers' MarianMTModel.from_pretrained)")


def _exported_here(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("nmt_export") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write_folder(transformers: Any, save_file: Any, folder: Path, loaded: model_file.TextModel,
                 state: dict[str, Any], path: Path) -> None:
    model, dictionary = loaded.model, loaded.dictionary
    save_file(marian_weights(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    marian_config(transformers, model.cfg, len(dictionary)).save_pretrained(folder)
    generation_config(transformers, model.cfg).save_pretrained(folder)
    (folder / "source.spm").write_bytes(loaded.spm_model)
    (folder / "target.spm").write_bytes(loaded.target_spm_model)
    (folder / "vocab.json").write_text(json.dumps({s: i for i, s in enumerate(dictionary.symbols)},
                                                  ensure_ascii=False, indent=0), encoding="utf-8")
    meta = state.get("meta", {})
    tokenizer = transformers.MarianTokenizer(
        str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"),
        source_lang=meta.get("src_lang"), target_lang=meta.get("tgt_lang"),
        unk_token=dictionary.symbols[UNK], eos_token=dictionary.symbols[EOS],
        pad_token=dictionary.symbols[PAD], model_max_length=model.cfg.max_positions,
        # special, so that decoding with skip_special_tokens drops the decoder's first token
        bos_token=dictionary.symbols[BOS])
    tokenizer.save_pretrained(folder)
    card = model_card(model.cfg, dictionary, state, loaded, path)
    (folder / "README.md").write_text(card, encoding="utf-8")


def model_card(cfg: ModelConfig, dictionary: Dictionary, state: dict[str, Any],
               loaded: model_file.TextModel, path: Path) -> str:
    """The folder's README.md: what the model file records of its data, settings and scores."""
    meta, train = state.get("meta", {}), state.get("train", {})
    src, tgt = meta.get("src_lang"), meta.get("tgt_lang")
    langs = f"language:\n- {src}\n- {tgt}\n" if src and tgt else ""
    settings = "\n".join(f"| `{k}` | `{v}` |" for k, v in dataclasses.asdict(cfg).items())
    scores = {k: meta[k] for k in ("valid_loss", "update", "epoch", "updates") if meta.get(k) is not None}
    scores.update({k: train[k] for k in ("best_valid_loss", "best_valid_bleu") if train.get(k) is not None})
    recorded = "\n".join(f"- {k}: {v}" for k, v in scores.items()) or "- none recorded in the model file"
    norm = state.get("source_normalization")
    trained = (train.get("config") or {}).get("data") or [a.get("file") for a in meta.get("averaged", [])]
    return f"""---
{langs}library_name: transformers
pipeline_tag: translation
tags:
- translation
- marian
- nmt
---
# {path.stem} ({src or '?'} to {tgt or '?'})

A Transformer (arXiv 1706.03762) made with nmt {__version__} and
exported by `nmt export huggingface {path.name}` as a MarianMT model.

## Data
- languages: {src or 'not recorded'} -> {tgt or 'not recorded'}
- source normalisation applied to the training text (apply it to input text too): {norm}
- vocabulary: {len(dictionary)} symbols, ids as in nmt (`<pad>` 0, `<s>` 1, `</s>` 2, `<unk>` 3);
  {'separate source and target sentencepiece models' if loaded.target_spm_model != loaded.spm_model
   else 'one sentencepiece model for both sides (source.spm = target.spm)'}
- origin: {meta.get('imported_from') or 'trained with nmt'}; the training data folder or the
  checkpoints averaged: {trained or 'not recorded'}

## Settings
| setting | value |
|---|---|
{settings}

## Scores the model file records
{recorded}

## Use
```python
from transformers import MarianMTModel, MarianTokenizer
tokenizer = MarianTokenizer.from_pretrained("THIS_FOLDER")
model = MarianMTModel.from_pretrained("THIS_FOLDER")
batch = tokenizer(["A sentence to translate."], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```
`generate`'s defaults (generation_config.json: beam {BEAM}, length penalty |Y|^{ALPHA}, stop once
{BEAM} hypotheses finish) search as `nmt translate --length-penalty fairseq --stop beam` does; the
logits are nmt's (the weights are nmt's, renumbered exactly). transformers limits the output length
per batch, nmt per sentence (source length + 50).
"""
