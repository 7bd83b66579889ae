"""`nmt import fairseq`: a fairseq `transformer` checkpoint as an nmt model file.

What fairseq does differently from nmt's defaults is reproduced, not approximated:
- its dictionaries put `<s> <pad> </s> <unk>` at ids 0-3 where nmt has `<pad> <s> </s> <unk>`: the
  rows of every vocabulary-sized matrix are permuted to match;
- separate source and target dictionaries become one nmt dictionary, the target's symbols first
  (`model.output_vocab` of them, all the decoder scores) and the source-only symbols after; a
  source-embedding row of a symbol the source dictionary lacks is its `<unk>` row, as fairseq would read it;
- its decoder reads `</s>` first (`model.decoder_start: eos`);
- its sinusoids (`model.positions: fairseq_sinusoidal`) and learned position tables, whose first two
  rows (up to its padding index) are never read: position p reads row p + 2;
- the embedding scale sqrt(d_model), pre-norm's final layer norms, and every sharing of embeddings.
Anything else a checkpoint may use is refused by name (`unsupported`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nmt_cli.config.convert import FairseqImportConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import SPECIALS, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.fairseq_pickle import load_checkpoint
from nmt_cli.model.transformer import Transformer, build_model

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
# nmt id of each fairseq special id: <s> 0 -> 1, <pad> 1 -> 0, </s> 2 -> 2, <unk> 3 -> 3
SPECIAL_IDS = [SPECIALS.index(s) for s in FAIRSEQ_SPECIALS]
UNK = 3  # the same id in both
# Settings nmt cannot express, each with the value that nmt's model has: anything else is refused.
PLAIN = {"activation_fn": "relu", "adaptive_softmax_cutoff": None, "adaptive_input": False,
         "no_token_positional_embeddings": False, "no_scale_embedding": False, "layernorm_embedding": False,
         "cross_self_attention": False, "no_cross_attention": False, "tie_adaptive_weights": False,
         "encoder_layerdrop": 0, "decoder_layerdrop": 0, "quant_noise_pq": 0, "quant_noise_scalar": 0,
         "encoder_layers_to_keep": None, "decoder_layers_to_keep": None, "no_decoder_final_norm": False,
         "merge_src_tgt_embed": False, "char_inputs": False, "offload_activations": False}
# fairseq's base_architecture defaults, for a setting an old checkpoint does not record
DEFAULTS = {"encoder_embed_dim": 512, "encoder_ffn_embed_dim": 2048, "encoder_layers": 6,
            "encoder_attention_heads": 8, "encoder_normalize_before": False, "encoder_learned_pos": False,
            "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
            "share_all_embeddings": False, "share_decoder_input_output_embed": False,
            "max_source_positions": 1024, "max_target_positions": 1024}
# Settings fairseq keeps for the encoder and the decoder apart and nmt's model has once.
PAIRED = [("encoder_embed_dim", "decoder_embed_dim"), ("encoder_ffn_embed_dim", "decoder_ffn_embed_dim"),
          ("encoder_attention_heads", "decoder_attention_heads"),
          ("encoder_normalize_before", "decoder_normalize_before"),
          ("encoder_learned_pos", "decoder_learned_pos"), ("encoder_embed_dim", "decoder_output_dim"),
          ("encoder_embed_dim", "decoder_input_dim")]


def run(cfg: FairseqImportConfig) -> None:
    checkpoint = Path(cfg.checkpoint)
    state, args = read(checkpoint)
    src_dict, tgt_dict = _dictionary_files(cfg, checkpoint, state)
    spm = cfg.spm or _one_beside(checkpoint, "*.model", "--spm")
    model, dictionary = convert(state, args, read_dict(src_dict), read_dict(tgt_dict), f"{checkpoint}")
    written = {**model_file.model_state(model, model.cfg, dictionary, spm.read_bytes()), "kind": "model",
               "meta": {"imported_from": str(checkpoint), "fairseq_arch": args.get("arch")}}
    model_file.save(Path(cfg.out), written)
    print(f"imported {checkpoint} ({args.get('arch')}: {model.cfg.encoder_layers}+{model.cfg.decoder_layers} "
          f"layers, d_model {model.cfg.d_model}, {model.cfg.norm}-norm, {model.cfg.positions} positions, "
          f"embeddings shared: {model.cfg.share_embeddings}, dictionary {len(dictionary)}) -> {cfg.out}")


def read(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(the model's state dict, its settings) of a checkpoint, refused unless it is a translation
    Transformer whose every setting nmt can express."""
    ckpt = load_checkpoint(path)
    weights = ckpt.get("model")
    if not isinstance(weights, dict) or not all(isinstance(v, Tensor) for v in weights.values()):
        raise NmtError(f"{path} is not a fairseq checkpoint: it has no 'model' state dict of tensors")
    cfg = ckpt.get("cfg") or {}
    args = cfg.get("model") if isinstance(cfg.get("model"), dict) else ckpt.get("args")
    if not isinstance(args, dict):
        raise NmtError(f"{path} records no model settings (neither cfg.model nor args)")
    task = cfg.get("task") or {}
    task_name = task.get("_name") if isinstance(task, dict) else None
    args = {**DEFAULTS, **args}
    for enc, dec in PAIRED:  # fairseq's decoder settings default to the encoder's
        args[dec] = args[enc] if args.get(dec) is None else args[dec]
    unsupported(path, args, task_name or args.get("task"))
    return weights, args


def unsupported(path: Path, args: dict[str, Any], task: Any) -> None:
    """Refuse, by name, a task, architecture or setting nmt's model cannot reproduce exactly."""
    arch = str(args.get("arch") or args.get("_name") or "")
    problems = []
    if task not in (None, "translation"):
        problems.append(f"task '{task}' (only 'translation' models)")
    if not arch.startswith("transformer") or arch.startswith(("transformer_lm", "transformer_align")):
        problems.append(f"architecture '{arch}' (only fairseq's transformer* translation architectures)")
    problems += [f"{name}={args[name]!r} (nmt's model has {value!r})" for name, value in PLAIN.items()
                 if not _same(args.get(name, value), value)]
    problems += [f"{enc}={args[enc]!r} with {dec}={args[dec]!r} (one setting of nmt's model)"
                 for enc, dec in PAIRED if not _same(args[dec], args[enc])]
    if problems:
        raise NmtError(f"{path} uses what nmt cannot express exactly: {'; '.join(problems)}")


def _same(actual: Any, expected: Any) -> bool:
    """Equal, counting a setting left unset (None) as off."""
    return actual == expected or (actual is None and expected in (False, 0, None))


def read_dict(path: Path) -> list[str]:
    """The symbols of a fairseq dict.txt (`SYMBOL COUNT [#fairseq:overwrite]` per line), in id order
    after the four specials."""
    if not path.is_file():
        raise NmtError(f"{path} does not exist: give the fairseq dictionary with --src-dict/--tgt-dict")
    symbols = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.rstrip().rsplit(" ", 2 if line.rstrip().endswith("#fairseq:overwrite") else 1)
        if len(fields) < 2 or not fields[1].lstrip("-").isdigit():
            raise NmtError(f"{path}, line {number}: expected 'SYMBOL COUNT' as fairseq writes, got {line!r}")
        symbols.append(fields[0])
    return symbols


def _one_beside(checkpoint: Path, pattern: str, option: str) -> Path:
    found = sorted(checkpoint.parent.glob(pattern))
    if len(found) != 1:
        raise NmtError(f"{'no' if not found else 'more than one'} {pattern} file beside {checkpoint}: "
                       f"name it with {option}")
    return found[0]


def _dictionary_files(cfg: FairseqImportConfig, checkpoint: Path,
                      weights: dict[str, Tensor]) -> tuple[Path, Path]:
    """--src-dict/--tgt-dict, else the two dict.LANG.txt beside the checkpoint (or one, joined), told
    apart by the sizes of the encoder's and decoder's embeddings."""
    if cfg.src_dict and cfg.tgt_dict:
        return Path(cfg.src_dict), Path(cfg.tgt_dict)
    found = sorted(checkpoint.parent.glob("dict.*.txt"))
    rows = {side: len(weights[f"{side}.embed_tokens.weight"]) for side in ("encoder", "decoder")
            if f"{side}.embed_tokens.weight" in weights}
    sized = {side: [f for f in found if len(f.read_text(encoding="utf-8").splitlines()) + 4 == n]
             for side, n in rows.items()}
    pick = {side: files[0] for side, files in sized.items()
            if files and all(f.read_bytes() == files[0].read_bytes() for f in files)}
    if len(pick) != 2:
        raise NmtError(f"cannot tell which dict.*.txt beside {checkpoint} is the source and which the target "
                       "dictionary: name them with --src-dict and --tgt-dict")
    return Path(cfg.src_dict or pick["encoder"]), Path(cfg.tgt_dict or pick["decoder"])


def model_config(args: dict[str, Any], weights: dict[str, Tensor], output_vocab: int) -> ModelConfig:
    learned = bool(args["encoder_learned_pos"])
    if learned:  # fairseq's tables have padding index + 1 = 2 rows before position 0
        max_positions = min(len(weights[f"{s}.embed_positions.weight"]) for s in ("encoder", "decoder")) - 2
    else:
        max_positions = min(int(args["max_source_positions"]), int(args["max_target_positions"]))
    share = ("all" if args["share_all_embeddings"] else
             "target" if args["share_decoder_input_output_embed"] else "none")
    return ModelConfig(
        encoder_layers=int(args["encoder_layers"]), decoder_layers=int(args.get("decoder_layers") or 6),
        d_model=int(args["encoder_embed_dim"]), d_ff=int(args["encoder_ffn_embed_dim"]),
        heads=int(args["encoder_attention_heads"]), dropout=float(args["dropout"]),
        attention_dropout=float(args["attention_dropout"]),
        activation_dropout=float(args.get("activation_dropout") or args.get("relu_dropout") or 0.0),
        max_positions=max_positions, norm="pre" if args["encoder_normalize_before"] else "post",
        positions="learned" if learned else "fairseq_sinusoidal", share_embeddings=share,
        shared_positions=not learned, output_vocab=output_vocab, decoder_start="eos")


def convert(weights: dict[str, Tensor], args: dict[str, Any], src_symbols: list[str], tgt_symbols: list[str],
            where: str) -> tuple[Transformer, Dictionary]:
    """The nmt model and dictionary of a fairseq model's weights, settings and dictionaries' symbols."""
    joined = src_symbols == tgt_symbols
    tgt_set = set(tgt_symbols)
    symbols = [*SPECIALS, *tgt_symbols, *([] if joined else [s for s in src_symbols if s not in tgt_set])]
    if len(set(symbols)) != len(symbols):
        raise NmtError(f"{where}: a dictionary holds a symbol twice or one of the special symbols")
    dictionary = Dictionary(symbols, [0] * len(symbols))
    output_vocab = 0 if joined else len(SPECIALS) + len(tgt_symbols)
    cfg = model_config(args, weights, output_vocab)
    src_ids = {s: i for i, s in enumerate([*FAIRSEQ_SPECIALS, *src_symbols])}
    # fairseq's row of each nmt symbol: the specials permuted, then the same order; unknown: <unk>
    tgt_rows = [*SPECIAL_IDS, *range(4, 4 + len(tgt_symbols))]
    tgt_rows += [UNK] * (len(symbols) - len(tgt_rows))
    src_rows = [*SPECIAL_IDS, *(src_ids.get(s, UNK) for s in symbols[4:])]
    nmt_weights = _rename(weights, cfg, src_rows, tgt_rows, where)
    return build_model(cfg, dictionary, nmt_weights, where).eval(), dictionary


def _rows(weights: dict[str, Tensor], name: str, rows: list[int], where: str) -> Tensor:
    table = weights[name]
    if max(rows) >= len(table):
        raise NmtError(f"{where}: {name} has {len(table)} rows, fewer than its dictionary's {max(rows) + 1}: "
                       "is the dictionary the one this model was trained with?")
    return table[rows].clone()


def _rename(w: dict[str, Tensor], cfg: ModelConfig, src_rows: list[int], tgt_rows: list[int],
            where: str) -> dict[str, Tensor]:
    """fairseq's parameter names and layouts -> nmt's."""
    out = {"embed.weight": _rows(w, "decoder.embed_tokens.weight", tgt_rows, where)}
    if cfg.share_embeddings != "all":
        out["src_embed.weight"] = _rows(w, "encoder.embed_tokens.weight", src_rows, where)
    if cfg.share_embeddings == "none":
        out["output_proj.weight"] = _rows(w, "decoder.output_projection.weight",
                                          tgt_rows[: cfg.output_vocab or len(tgt_rows)], where)
    if cfg.positions == "learned":
        out["learned_positions.weight"] = w["decoder.embed_positions.weight"][2: 2 + cfg.max_positions]
        out["src_learned_positions.weight"] = w["encoder.embed_positions.weight"][2: 2 + cfg.max_positions]
    for name, value in w.items():
        if (m := re.fullmatch(r"(encoder|decoder)\.layers\.(\d+)\.(.+)", name)) is not None:
            target = _layer_name(m[1], m[2], m[3])
            if target is not None:
                out[target] = value
        elif name.startswith(("encoder.layer_norm.", "decoder.layer_norm.")):
            side, _, param = name.split(".")
            out[f"{side}_norm.{param}"] = value
    for side, layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            for attn in ("self_attn", "encoder_attn") if side == "decoder" else ("self_attn",):
                ours = f"{side}.{i}.{'cross_attn' if attn == 'encoder_attn' else attn}.in_proj"
                for param in ("weight", "bias"):
                    out[f"{ours}.{param}"] = torch.cat(
                        [w[f"{side}.layers.{i}.{attn}.{p}_proj.{param}"] for p in "qkv"])
    return {k: v.float().contiguous() for k, v in out.items()}


_NORMS = {"self_attn_layer_norm": {"encoder": "attn_block", "decoder": "self_block"},
          "encoder_attn_layer_norm": {"decoder": "cross_block"},
          "final_layer_norm": {"encoder": "ffn_block", "decoder": "ffn_block"}}


def _layer_name(side: str, i: str, rest: str) -> str | None:
    """nmt's name of one fairseq layer parameter (None: the q/k/v projections, stacked by `_rename`)."""
    module, _, param = rest.rpartition(".")
    if module in _NORMS:
        return f"{side}.{i}.{_NORMS[module][side]}.norm.{param}"
    if module in ("fc1", "fc2"):
        return f"{side}.{i}.ffn.{module}.{param}"
    if module in ("self_attn.out_proj", "encoder_attn.out_proj"):
        return f"{side}.{i}.{module.replace('encoder_attn', 'cross_attn')}.{param}"
    return None
