"""The configs of the converters: `nmt import fairseq` and `nmt export ctranslate2`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
