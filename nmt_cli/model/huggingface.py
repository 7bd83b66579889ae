"""`nmt import huggingface`: a MarianMT folder (the layout of the OPUS-MT models on the Hugging Face
Hub, read as data) as an nmt model file; and the one correspondence of parameters, both ways, that
`nmt export huggingface` (`inference/huggingface.py`) writes through.

MarianMT computes what nmt's post-norm Transformer computes, up to four differences of layout, each
reproduced exactly:
- its sinusoids lay out the sin of every frequency, then the cos (`MarianSinusoidalPositionalEmbedding`),
  where nmt interleaves them as section 3.5 writes PE(pos, 2i) = sin, PE(pos, 2i+1) = cos. The
  frequencies are the same. Renumbering the D coordinates of the residual stream by
  `PERM = [0, 2, 4, ..., 1, 3, 5, ...]` turns one table into the other, and changes nothing else the
  model computes (`residual_permutation`): so every weight that reads or writes the stream is permuted;
- OPUS-MT's vocabulary puts `</s>` first and `<pad>` last, and has no `<s>`; nmt's dictionary has
  `<pad> <s> </s> <unk>` at ids 0-3 (`data.dataset.SPECIALS`). The rows of every vocabulary-sized
  matrix are renumbered; an absent `<s>` gets a zero embedding and an output bias of `NEVER`, so that
  it takes no probability (nmt's search masks it anyway);
- its decoder reads `decoder_start_token_id` first (PAD in OPUS-MT: `model.decoder_start: pad`);
- a bias on the logits (`final_logits_bias`: `model.output_bias`) and the feed-forward activation
  (`swish` = SiLU as OPUS-MT uses, exact `gelu`, `relu`: `model.activation`).
Separate `source.spm` and `target.spm` over one `vocab.json` become the model file's `spm_model` and
`target_spm_model`. What nmt cannot reproduce exactly is refused by name (`unsupported`).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli.config.convert import HuggingfaceImportConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import SPECIALS, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer, build_model, sinusoids

MISSING = ("the safetensors package is not installed: pip install 'nmt-cli[huggingface]' "
           "(or pip install transformers safetensors)")
NEVER = -100.0  # the output bias of a token the imported model never scores: exp(-100) ~ 4e-44
# MarianMT's activation_function values nmt computes, as nmt's model.activation (SiLU is swish)
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# MarianConfig settings that must hold these values (anything else is refused by name)
REQUIRED = {"model_type": "marian", "scale_embedding": True, "is_encoder_decoder": True,
            "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}
# Settings MarianConfig keeps for the encoder and the decoder apart and nmt's model has once.
PAIRED = [("encoder_ffn_dim", "decoder_ffn_dim"), ("encoder_attention_heads", "decoder_attention_heads")]


def residual_permutation(d_model: int) -> Tensor:
    """PERM: coordinate k of MarianMT's residual stream is coordinate PERM[k] of nmt's.

    nmt's position table has sin(pos * w_i) in column 2i and cos(pos * w_i) in column 2i + 1;
    `table[:, PERM]` has the D/2 sines first, then the D/2 cosines: MarianMT's table. Such a
    renumbering is exact for the whole model when every map into the stream renumbers its outputs
    and every map out of it its inputs: for h' = h[PERM], W h = W[:, PERM] h' (the q/k/v projections,
    the first feed-forward layer, the tied output projection), (W x)[PERM] = W[PERM, :] x and the
    bias b[PERM] (the attention output projections, the second feed-forward layer, the embedding
    columns); a layer norm's mean and variance over the coordinates do not depend on their order, and
    its gain and bias are applied per coordinate, so they take [PERM] too. Nothing else reads the
    stream (heads and the feed-forward inner width are not renumbered), so every output is the
    same number, not an approximation (tests/test_huggingface.py checks both)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# How each nmt parameter meets the residual stream: "in" its columns read it, "out" its rows write it,
# "vec" a vector in it; anything else (the q/k/v biases, the first feed-forward bias) does neither.
def _layer_params(side: str, i: int) -> Iterator[tuple[str, str, str]]:
    """(nmt name, MarianMT name, how) of each parameter of layer i of `side`; the attentions' stacked
    W^Q W^K W^V appear under MarianMT's q_proj name, split and joined by the callers."""
    ours, theirs = f"{side}.{i}", f"model.{side}.layers.{i}"
    attentions = [("self_attn", "self_attn", "attn_block" if side == "encoder" else "self_block")]
    if side == "decoder":
        attentions.append(("cross_attn", "encoder_attn", "cross_block"))
    for mine, hf, block in attentions:
        yield f"{ours}.{mine}.in_proj.weight", f"{theirs}.{hf}.q_proj.weight", "in"
        yield f"{ours}.{mine}.in_proj.bias", f"{theirs}.{hf}.q_proj.bias", "plain"
        yield f"{ours}.{mine}.out_proj.weight", f"{theirs}.{hf}.out_proj.weight", "out"
        yield f"{ours}.{mine}.out_proj.bias", f"{theirs}.{hf}.out_proj.bias", "vec"
        for param in ("weight", "bias"):
            yield f"{ours}.{block}.norm.{param}", f"{theirs}.{hf}_layer_norm.{param}", "vec"
    yield f"{ours}.ffn.fc1.weight", f"{theirs}.fc1.weight", "in"
    yield f"{ours}.ffn.fc1.bias", f"{theirs}.fc1.bias", "plain"
    yield f"{ours}.ffn.fc2.weight", f"{theirs}.fc2.weight", "out"
    yield f"{ours}.ffn.fc2.bias", f"{theirs}.fc2.bias", "vec"
    for param in ("weight", "bias"):
        yield f"{ours}.ffn_block.norm.{param}", f"{theirs}.final_layer_norm.{param}", "vec"


def layer_params(cfg: ModelConfig) -> Iterator[tuple[str, str, str]]:
    for side, layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            yield from _layer_params(side, i)


def renumber(t: Tensor, how: str, index: Tensor) -> Tensor:
    """t with its residual-stream coordinates taken in the order `index` (PERM: nmt -> MarianMT;
    its inverse: back)."""
    match how:
        case "in":
            return t.index_select(-1, index)
        case "out" | "vec":
            return t.index_select(0, index)
    return t


# -- import ---------------------------------------------------------------------------------------


def run(cfg: HuggingfaceImportConfig) -> None:
    folder = Path(cfg.folder)
    settings, vocab = _json(folder / "config.json"), _json(folder / "vocab.json")
    source_spm, target_spm = (_file(folder / name) for name in ("source.spm", "target.spm"))
    model, dictionary = convert(settings, read_weights(folder), vocab, str(folder))
    state = model_file.model_state(model, model.cfg, dictionary, source_spm,
                                   target_spm_model=None if target_spm == source_spm else target_spm)
    model_file.save(Path(cfg.out), {**state, "kind": "model",
                                    "meta": {"imported_from": str(folder), "marian": True}})
    if cfg.dict_out is not None:
        dictionary.save(Path(cfg.dict_out))
    c = model.cfg
    print(f"imported {folder} (MarianMT: {c.encoder_layers}+{c.decoder_layers} layers, d_model {c.d_model}, "
          f"{c.activation}, decoder start {c.decoder_start}, "
          f"{'separate' if target_spm != source_spm else 'one'} sentencepiece model(s), dictionary "
          f"{len(dictionary)}) -> {cfg.out}")


def _file(path: Path) -> bytes:
    if not path.is_file():
        raise NmtError(f"{path} is missing: a MarianMT folder holds config.json, vocab.json, source.spm, "
                       "target.spm and model.safetensors (or pytorch_model.bin)")
    return path.read_bytes()


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(_file(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise NmtError(f"{path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise NmtError(f"{path} is not a JSON object as transformers writes it")
    return value


def read_weights(folder: Path) -> dict[str, Tensor]:
    """The tensors of model.safetensors, or else of pytorch_model.bin read with
    `torch.load(weights_only=True)`: data only, never a pickle's code."""
    if (folder / "model.safetensors").is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise NmtError(MISSING) from None
        try:
            return load_file(str(folder / "model.safetensors"))
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for damage)
            raise NmtError(f"{folder}/model.safetensors cannot be read ({type(e).__name__}: {e})") from None
    path = folder / "pytorch_model.bin"
    if not path.is_file():
        raise NmtError(f"{folder} holds neither model.safetensors nor pytorch_model.bin")
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise NmtError(f"{path} was refused: it holds objects other than tensors, which could run code "
                       f"when loaded ({str(e).splitlines()[0]}); convert it to model.safetensors in a "
                       "trusted environment") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise NmtError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(weights, dict) or not all(isinstance(v, Tensor) for v in weights.values()):
        raise NmtError(f"{path} is not a state dict of tensors")
    return weights


def unsupported(settings: dict[str, Any], vocab_size: int) -> list[str]:
    """The settings of a MarianConfig nmt cannot reproduce exactly, each named with nmt's value."""
    problems = [f"{name}={settings.get(name)!r} (nmt's model has {value!r})" for name, value in
                REQUIRED.items() if settings.get(name, value) != value]
    problems += [f"{a}={settings.get(a)!r} with {b}={settings.get(b)!r} (one setting of nmt's model)"
                 for a, b in PAIRED if settings.get(a) != settings.get(b)]
    if settings.get("activation_function") not in ACTIVATIONS:
        problems.append(f"activation_function={settings.get('activation_function')!r} "
                        f"(nmt has {', '.join(sorted(ACTIVATIONS))})")
    if settings.get("decoder_vocab_size") not in (None, settings.get("vocab_size")):
        problems.append(f"decoder_vocab_size={settings['decoder_vocab_size']!r} with vocab_size="
                        f"{settings.get('vocab_size')!r} (separate vocabularies; nmt reads one vocab.json)")
    if settings.get("vocab_size") != vocab_size:
        problems.append(f"vocab_size={settings.get('vocab_size')!r} but vocab.json holds {vocab_size} ids")
    if (settings.get("d_model") or 0) % max(int(settings.get("encoder_attention_heads") or 1), 1):
        problems.append(f"d_model={settings.get('d_model')!r} not divisible by the heads")
    return problems


def model_config(settings: dict[str, Any], start: str, output_bias: bool) -> ModelConfig:
    share = bool(settings.get("share_encoder_decoder_embeddings", True))
    tied = bool(settings.get("tie_word_embeddings", True))
    return ModelConfig(
        encoder_layers=int(settings["encoder_layers"]), decoder_layers=int(settings["decoder_layers"]),
        d_model=int(settings["d_model"]), d_ff=int(settings["encoder_ffn_dim"]),
        heads=int(settings["encoder_attention_heads"]), dropout=float(settings.get("dropout", 0.1)),
        attention_dropout=float(settings.get("attention_dropout", 0.0)),
        activation_dropout=float(settings.get("activation_dropout", 0.0)),
        max_positions=int(settings.get("max_position_embeddings", 1024)),
        share_embeddings="all" if share and tied else "target" if tied else "none",
        decoder_start=start, activation=ACTIVATIONS[settings["activation_function"]],
        output_bias=output_bias)


def _symbols(vocab: dict[str, Any], where: str) -> list[str]:
    """vocab.json's symbols in id order, refused unless the ids are 0..N-1 once each."""
    by_id: dict[int, str] = {}
    for symbol, i in vocab.items():
        if type(i) is not int or not 0 <= i < len(vocab) or i in by_id:
            raise NmtError(f"{where}/vocab.json: {symbol!r} has id {i!r}; the ids must be "
                           f"0..{len(vocab) - 1}, each once")
        by_id[i] = symbol
    return [by_id[i] for i in range(len(vocab))]


def dictionary_rows(symbols: list[str], settings: dict[str, Any],
                    where: str) -> tuple[Dictionary, list[int]]:
    """nmt's dictionary (the specials at nmt's ids, then MarianMT's other symbols in its order) and
    the MarianMT row of each nmt id (-1: `<s>`, which OPUS-MT's vocabularies lack)."""
    ids = {s: i for i, s in enumerate(symbols)}
    named = {"<pad>": "pad_token_id", "</s>": "eos_token_id"}
    for symbol, key in named.items():
        if settings.get(key) != ids.get(symbol):
            raise NmtError(f"{where}: config.json's {key} ({settings.get(key)!r}) is not the id of {symbol} "
                           f"in vocab.json ({ids.get(symbol)!r}); nmt needs {symbol} to be that token")
    if "<unk>" not in ids:
        raise NmtError(f"{where}/vocab.json has no <unk>")
    codes = [s for s in symbols if s.startswith(">>") and s.endswith("<<")]
    if codes:
        raise NmtError(f"{where}/vocab.json holds target-language codes ({', '.join(codes[:3])}, ...): a "
                       "multilingual model, whose tokenizer keeps a leading >>xx<< whole; nmt does not")
    ordered = [*SPECIALS, *(s for s in symbols if s not in SPECIALS)]
    rows = [ids.get(s, -1) for s in ordered]
    return Dictionary(ordered, [0] * len(ordered)), rows


def _table(weights: dict[str, Tensor], name: str, rows: list[int], inverse: Tensor, where: str) -> Tensor:
    """An embedding-like (V, D) MarianMT matrix as nmt's: rows renumbered, columns un-permuted, a zero
    row for `<s>` where MarianMT has none."""
    table = _tensor(weights, name, where)
    out = torch.zeros(len(rows), table.shape[1], dtype=torch.float32)
    present = torch.tensor([r >= 0 for r in rows])
    out[present] = table[torch.tensor([r for r in rows if r >= 0])].float()
    return renumber(out, "in", inverse)


def _tensor(weights: dict[str, Tensor], name: str, where: str) -> Tensor:
    for key in (name, name.removeprefix("model.")):  # saved from MarianMTModel, or from MarianModel
        if key in weights:
            return weights[key]
    raise NmtError(f"{where}: the weights have no {name}: is this a MarianMT model's folder?")


def convert(settings: dict[str, Any], weights: dict[str, Tensor], vocab: dict[str, Any],
            where: str) -> tuple[Transformer, Dictionary]:
    """The nmt model and dictionary of a MarianMT model's config.json, tensors and vocab.json."""
    problems = unsupported(settings, len(vocab))
    if problems:
        raise NmtError(f"{where} uses what nmt cannot express exactly: {'; '.join(problems)}")
    dictionary, rows = dictionary_rows(_symbols(vocab, where), settings, where)
    bias = (_tensor(weights, "final_logits_bias", where).reshape(-1).float()
            if any(k.endswith("final_logits_bias") for k in weights) else torch.zeros(len(vocab)))
    nmt_bias = torch.tensor([float(bias[r]) if r >= 0 else NEVER for r in rows])
    cfg = model_config(settings, _decoder_start(settings, vocab, where), output_bias=bool(nmt_bias.any()))
    _check_positions(weights, cfg, where)
    out = _embeddings(weights, cfg, rows, where)
    if cfg.output_bias:
        out["output_bias"] = nmt_bias
    inverse = torch.argsort(residual_permutation(cfg.d_model))
    for ours, theirs, how in layer_params(cfg):
        if ".q_proj." in theirs:  # nmt stacks W^Q, W^K, W^V
            value = torch.cat([_tensor(weights, theirs.replace(".q_proj.", f".{p}_proj."), where)
                               for p in "qkv"])
        else:
            value = _tensor(weights, theirs, where)
        out[ours] = renumber(value.float(), how, inverse).contiguous()
    return build_model(cfg, dictionary, out, where).eval(), dictionary


def _decoder_start(settings: dict[str, Any], vocab: dict[str, Any], where: str) -> str:
    start = {settings.get("pad_token_id"): "pad", settings.get("eos_token_id"): "eos",
             vocab.get("<s>", -2): "bos"}.get(settings.get("decoder_start_token_id"))
    if start is None:
        raise NmtError(f"{where}: decoder_start_token_id={settings.get('decoder_start_token_id')!r} is "
                       "none of <pad>, </s>, <s>, the tokens nmt's decoder can start with")
    return start


def _embeddings(weights: dict[str, Tensor], cfg: ModelConfig, rows: list[int],
                where: str) -> dict[str, Tensor]:
    """nmt's embedding matrices (and separate output projection) of MarianMT's."""
    inverse = torch.argsort(residual_permutation(cfg.d_model))
    shared = any(k.endswith("shared.weight") for k in weights)
    names = {"embed.weight": "model.shared.weight" if shared else "model.decoder.embed_tokens.weight"}
    if cfg.share_embeddings != "all":
        names["src_embed.weight"] = "model.encoder.embed_tokens.weight"
    if cfg.share_embeddings == "none":
        names["output_proj.weight"] = "lm_head.weight"
    return {ours: _table(weights, theirs, rows, inverse, where) for ours, theirs in names.items()}


def _check_positions(weights: dict[str, Tensor], cfg: ModelConfig, where: str) -> None:
    """A position table in the folder (MarianMT rebuilds its own and does not save it; an export by
    nmt writes it) must be the sinusoids nmt computes, else the model is not one nmt can express."""
    expected = sinusoids(cfg.max_positions, cfg.d_model)[:, residual_permutation(cfg.d_model)]
    for side in ("encoder", "decoder"):
        name = f"model.{side}.embed_positions.weight"
        table = weights.get(name, weights.get(name.removeprefix("model.")))
        if table is not None and (table.shape != expected.shape
                                  or not torch.allclose(table.float(), expected, atol=1e-4)):
            raise NmtError(f"{where}: {name} is not MarianMT's sinusoidal table of max_position_embeddings="
                           f"{cfg.max_positions} rows (trained positions?): nmt cannot express it")
