"""CTranslate2: `nmt export ctranslate2 MODEL --out DIR` and `nmt translate DIR`.

The export fills the `ctranslate2` package's own Transformer spec (its model-spec API) with the
model's weights: each attention's W^Q, W^K, W^V stacked as CTranslate2 fuses them, the position
table as the model adds it (the paper's sinusoids, fairseq's, or a learned table; CTranslate2 takes
any table), the embedding scale sqrt(d_model), the source and target vocabularies (the target's only
the entries the decoder scores). The folder is self-contained: CTranslate2's model and vocabularies,
the sentencepiece model, nmt's dictionary and `nmt.json` (what `nmt translate DIR` needs), written
to a temporary folder first and renamed, so a crash leaves no half folder under DIR's name.

`nmt translate DIR` reads lines as `nmt translate MODEL` does (the same `Translator`: the same
cleaning, encoding, truncation warnings, blank lines and output layout); CTranslate2 runs the search
(`Engine`). Its length penalty is fairseq's |Y|^alpha, and its output-length limit is one for the
batch, so each hypothesis is cut here at nmt's per-sentence limit a * |X| + b.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmt_cli.config.convert import Ctranslate2ExportConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.data.clean import Normalization
from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError, shown
from nmt_cli.inference.search import Hypothesis, cpu_workers
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

FORMAT = "nmt-ctranslate2/1"
Warn = Callable[[str], None]
# What `Translator` runs instead of nmt's search: source ids (each ending in EOS) -> each one's n-best
Search = Callable[[Sequence[Sequence[int]], TranslateConfig, Callable[[int], None] | None],
                  list[list[Hypothesis]]]
MISSING = ("the ctranslate2 package is not installed: pip install 'nmt-cli[ctranslate2]' "
           "(or pip install ctranslate2)")

SHARED_BATCH = 3072  # source tokens a batch when CTranslate2 searches several at once


def _ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise NmtError(MISSING) from None
    return ctranslate2


# -- export ---------------------------------------------------------------------------------------


def run(cfg: Ctranslate2ExportConfig) -> None:
    ct2 = _ctranslate2()
    model, dictionary, spm_bytes, normalization = model_file.load_model_for_text(Path(cfg.model))
    spec = model_spec(ct2, model, dictionary, Path(cfg.model))
    out = Path(cfg.out)
    if out.exists() and not (out / "nmt.json").is_file():
        raise NmtError(f"{out} exists and is not an exported nmt model: give another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # beside DIR: one disk, one rename
    try:
        spec.validate()
        spec.optimize(quantization=None if cfg.quantization == "float32" else cfg.quantization)
        spec.save(str(tmp))
        (tmp / "spm.model").write_bytes(spm_bytes)
        dictionary.save(tmp / "dict.txt")
        # the model file's source normalisation goes with it: `nmt translate DIR` applies it as
        # `nmt translate MODEL` does (None: the file does not say, and neither does the folder)
        (tmp / "nmt.json").write_text(json.dumps({
            "format": FORMAT, "model": str(cfg.model), "max_positions": model.cfg.max_positions,
            "quantization": cfg.quantization,
            "source_normalization": None if normalization is None else normalization.record()}),
            encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {cfg.model} ({cfg.quantization}) -> {out}")


def model_spec(ct2: Any, model: Transformer, dictionary: Dictionary, path: Path) -> Any:
    """CTranslate2's TransformerSpec holding `model`'s weights, or a refusal naming the setting."""
    cfg = model.cfg
    if cfg.d_k or cfg.d_v:
        raise NmtError(f"{path}: CTranslate2 cannot represent model.d_k/model.d_v other than d_model / h")
    # the settings of an imported MarianMT model, which this export does not carry
    unsupported = [f"model.{name}={value!r}" for name, value, carried in
                   (("activation", cfg.activation, ("relu",)), ("output_bias", cfg.output_bias, (False,)),
                    ("decoder_start", cfg.decoder_start, ("bos", "eos"))) if value not in carried]
    if unsupported:
        raise NmtError(f"{path}: the CTranslate2 export does not carry {', '.join(unsupported)}; "
                       "export it with `nmt export huggingface` instead")
    spec = ct2.specs.TransformerSpec.from_config((cfg.encoder_layers, cfg.decoder_layers), cfg.heads,
                                                 pre_norm=cfg.norm == "pre")
    w = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if cfg.positions == "learned":
        tgt_table = w["learned_positions.weight"]
        src_table = w.get("src_learned_positions.weight", tgt_table)
    else:  # the sinusoid buffer, not in the state dict
        src_table = tgt_table = model.positions.float().numpy()
    out_vocab = model.output_vocab
    src_embed = w["src_embed.weight"] if cfg.share_embeddings != "all" else w["embed.weight"]
    _inputs(spec.encoder, src_embed, src_table, cfg.d_model)
    _inputs(spec.decoder, w["embed.weight"][:out_vocab], tgt_table, cfg.d_model)
    spec.decoder.projection.weight = (w["output_proj.weight"] if cfg.share_embeddings == "none"
                                      else w["embed.weight"])[:out_vocab]
    for i, layer in enumerate(spec.encoder.layer):
        _attention(layer.self_attention, w, f"encoder.{i}.self_attn", f"encoder.{i}.attn_block", True)
        _ffn(layer.ffn, w, f"encoder.{i}")
    for i, layer in enumerate(spec.decoder.layer):
        _attention(layer.self_attention, w, f"decoder.{i}.self_attn", f"decoder.{i}.self_block", True)
        _attention(layer.attention, w, f"decoder.{i}.cross_attn", f"decoder.{i}.cross_block", False)
        _ffn(layer.ffn, w, f"decoder.{i}")
    if cfg.norm == "pre":
        _norm(spec.encoder.layer_norm, w, "encoder_norm")
        _norm(spec.decoder.layer_norm, w, "decoder_norm")
    # CTranslate2 names padding <blank>; nmt's other specials are its defaults
    vocab = ["<blank>" if s == "<pad>" else s for s in dictionary.symbols]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab[:out_vocab])
    spec.config.decoder_start_token = "</s>" if cfg.decoder_start == "eos" else "<s>"
    spec.config.add_source_eos = False  # nmt's encoding adds it
    return spec


def _inputs(side: Any, embed: np.ndarray, positions: np.ndarray, d_model: int) -> None:
    embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
    embeddings.weight = np.ascontiguousarray(embed)
    side.position_encodings.encodings = np.ascontiguousarray(positions)
    side.scale_embeddings = True  # sqrt(d_model)


def _attention(spec: Any, w: dict[str, np.ndarray], name: str, block: str, self_attention: bool) -> None:
    weight, bias = w[f"{name}.in_proj.weight"], w[f"{name}.in_proj.bias"]
    if self_attention:  # one fused W^Q W^K W^V, as nmt stores it
        spec.linear[0].weight, spec.linear[0].bias = weight, bias
        index = 1
    else:  # queries from the decoder, keys and values (fused) from the encoder output
        d = weight.shape[1]
        spec.linear[0].weight, spec.linear[0].bias = weight[:d], bias[:d]
        spec.linear[1].weight, spec.linear[1].bias = weight[d:], bias[d:]
        index = 2
    spec.linear[index].weight = w[f"{name}.out_proj.weight"]
    spec.linear[index].bias = w[f"{name}.out_proj.bias"]
    _norm(spec.layer_norm, w, f"{block}.norm")


def _ffn(spec: Any, w: dict[str, np.ndarray], layer: str) -> None:
    spec.linear_0.weight, spec.linear_0.bias = w[f"{layer}.ffn.fc1.weight"], w[f"{layer}.ffn.fc1.bias"]
    spec.linear_1.weight, spec.linear_1.bias = w[f"{layer}.ffn.fc2.weight"], w[f"{layer}.ffn.fc2.bias"]
    _norm(spec.layer_norm, w, f"{layer}.ffn_block.norm")


def _norm(spec: Any, w: dict[str, np.ndarray], name: str) -> None:
    spec.gamma, spec.beta = w[f"{name}.weight"], w[f"{name}.bias"]


# -- translate DIR --------------------------------------------------------------------------------


class _Limits:
    """What `Translator.encode` and the search read of a model: its positions."""

    def __init__(self, max_positions: int) -> None:
        self.cfg = type("Cfg", (), {"max_positions": max_positions})()


class Engine:
    """An exported folder loaded in CTranslate2, searching as `search.translate_ids` does: source ids
    in (each ending in EOS), each one's n-best `Hypothesis` out, in order."""

    def __init__(self, cfg: TranslateConfig, warn: Warn) -> None:
        ct2 = _ctranslate2()
        folder = Path(cfg.model[0])
        try:
            settings = json.loads((folder / "nmt.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise NmtError(f"{folder} is a folder but not one `nmt export ctranslate2` wrote (no readable "
                           "nmt.json): give a model file or an exported folder") from None
        if not isinstance(settings, dict) or settings.get("format") != FORMAT:
            raise NmtError(f"{folder}/nmt.json is not of this nmt's format {FORMAT}: export the model again")
        positions = settings.get("max_positions")
        if type(positions) is not int or positions < 1:
            raise NmtError(f"{folder}/nmt.json: its max_positions is damaged ({shown(positions)}); "
                           "export the model again")
        if cfg.beam > 1 and (cfg.length_penalty, cfg.stop) != ("fairseq", "beam"):
            warn("CTranslate2 searches as `--length-penalty fairseq --stop beam` do: it ranks hypotheses "
                 "with fairseq's length penalty |Y|^alpha and stops a sentence once `beam` hypotheses have "
                 "finished")
        self.model = _Limits(positions)
        # absent from folders exported before nmt carried it: those translate the raw text, as ever
        self.normalization = Normalization.from_record(settings.get("source_normalization"),
                                                       f"{folder}/nmt.json", "export the model again")
        self.dictionary = Dictionary.load(folder / "dict.txt")
        self.spm_bytes = (folder / "spm.model").read_bytes()
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        # On the CPU, as nmt's own search does: `threads` batches at once, each on one thread
        # (CTranslate2's inter_threads), which decoded faster than `threads` threads inside each batch
        # (benchmarks/README.md)
        self.workers = 1 if cuda else cpu_workers(cfg.threads)
        self.engine = ct2.Translator(str(folder), device="cuda" if cuda else "cpu",
                                     intra_threads=cfg.threads if cuda else 1, inter_threads=self.workers)

    def search(self, sources: Sequence[Sequence[int]], cfg: TranslateConfig,
               on_batch: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        """`cfg`: the search's settings (beam, n-best, length penalty, limits), the translator's: a
        server searches with each request's (`serve.batcher`)."""
        if not sources:
            return []
        symbols = self.dictionary.symbols
        limits = [int(cfg.max_len_a * (len(s) - 1) + cfg.max_len_b) for s in sources]
        longest = min(max(limits), self.model.cfg.max_positions - 1) + 1  # with EOS
        # On several CPU threads, batches of SHARED_BATCH tokens, which CTranslate2 searches in
        # parallel: on 2 threads, faster than halves or quarters of 15,000 tokens (benchmarks/README.md;
        # nmt's own search, with its larger cost per step, takes fewer, larger batches: `search._batches`)
        batch_tokens = cfg.max_tokens if self.workers == 1 else min(cfg.max_tokens, SHARED_BATCH)
        found = self.engine.translate_batch(
            [["<blank>" if i == 0 else symbols[i] for i in s] for s in sources], beam_size=cfg.beam,
            num_hypotheses=cfg.nbest, length_penalty=cfg.lenpen, max_decoding_length=longest,
            return_scores=True, max_batch_size=batch_tokens, batch_type="tokens")
        if on_batch is not None:
            on_batch(len(sources))
        # CTranslate2's limit is the batch's: each hypothesis is cut at its sentence's (nmt forces EOS there)
        return [[Hypothesis(self.dictionary.encode(tokens[:limit]), score,
                            score * (min(len(tokens), limit) + 1) ** cfg.lenpen)
                 for tokens, score in zip(result.hypotheses, result.scores, strict=True)]
                for limit, result in zip(limits, found, strict=True)]
