"""The configs of the converters: `nmt import fairseq`, `nmt export ctranslate2` and `nmt import/export
huggingface`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nmt_cli.config.core import opt, required


@dataclass
class FairseqImportConfig:
    checkpoint: Path = required("a fairseq checkpoint of a transformer translation model", argument=True)
    out: Path = required("the nmt model file to write", flag="--out", short="-o")
    src_dict: Path | None = opt(None, "fairseq's source dictionary (default: the dict.LANG.txt beside the "
                                "checkpoint whose size fits the encoder's embedding)", flag="--src-dict")
    tgt_dict: Path | None = opt(None, "fairseq's target dictionary (default: as --src-dict, for the "
                                "decoder)", flag="--tgt-dict")
    spm: Path | None = opt(None, "the sentencepiece model that made the pieces (default: the one *.model "
                           "file beside the checkpoint)", flag="--spm")


@dataclass
class Ctranslate2ExportConfig:
    model: Path = required("an nmt model file (a checkpoint, an averaged or imported model)", argument=True)
    out: Path = required("the folder to write: CTranslate2's model, the vocabularies, the sentencepiece "
                         "model and nmt.json; `nmt translate DIR` reads it", flag="--out", short="-o")
    quantization: Literal["float32", "int8", "int8_float32", "bfloat16", "float16"] = opt(
        "float32", "the weights' type in the folder (CTranslate2's quantization)", flag="--quantization")


@dataclass
class HuggingfaceImportConfig:
    folder: Path = required("a MarianMT folder as the OPUS-MT models ship (config.json, model.safetensors or "
                            "pytorch_model.bin, vocab.json, source.spm, target.spm)", argument=True)
    out: Path = required("the nmt model file to write", flag="--out", short="-o")
    dict_out: Path | None = opt(None, "also write the model's dictionary here, for `nmt binarize "
                                "--dictionary` before fine-tuning with `nmt train --init`", flag="--dict-out")


@dataclass
class HuggingfaceExportConfig:
    model: Path = required("an nmt model file (a checkpoint, an averaged or imported model)", argument=True)
    out: Path = required("the folder to write: what transformers' MarianMTModel and MarianTokenizer load "
                         "(config.json, model.safetensors, generation_config.json, source.spm, target.spm, "
                         "vocab.json, tokenizer_config.json, README.md)", flag="--out", short="-o")
