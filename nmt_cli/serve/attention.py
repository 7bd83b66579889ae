"""The cross-attention the page draws: what each target piece of a translation attended to in the
source (encoder-decoder attention, arXiv 1706.03762 section 3.2.3; the paper's figures 3-5 draw
attention weights so), computed as `nmt attention --kind cross` computes it.

A copy of the model, in float32 on the CPU, serves it, behind a lock: recording attention hooks
every attention layer of the model it runs on, which must not be the one the batcher's threads are
searching with at the same time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from nmt_cli.data.dataset import BOS, EOS
from nmt_cli.evaluation.attention_maps import attention_maps, token_label
from nmt_cli.inference.translate import Translator
from nmt_cli.model import file as model_file


class AttentionModel:
    def __init__(self, path: Path, translator: Translator) -> None:
        self.model = model_file.load_text_model(path, "cpu").model.float().eval()
        self.translator = translator  # its source encoding (normalised as in training) and dictionary
        self.lock = threading.Lock()

    def cross(self, source: str, translation: str) -> dict[str, Any]:
        """{source_labels, target_labels, weights[t][s] (the last layer's heads averaged), layer}.
        The target is the translation's pieces, teacher-forced; each row sums to 1."""
        translator = self.translator
        src = translator.encode(source, 1)
        limit = self.model.cfg.max_positions - 1
        target = translator.dictionary.encode(translator.target_sp.encode(translation, out_type=str))[:limit]
        with self.lock, torch.inference_mode():
            _, maps = attention_maps(self.model, torch.tensor([src]), torch.tensor([[BOS, *target]]))
        layers = len(self.model.decoder)
        weights = maps[("cross", layers - 1)][0].mean(dim=0)  # (H, T, S) -> (T, S)
        symbols = translator.dictionary.symbols
        return {"source": source, "translation": translation, "layer": layers,
                "source_labels": [token_label(symbols[i]) for i in src],
                "target_labels": [token_label(symbols[i]) for i in [*target, EOS]],
                "weights": [[round(w, 4) for w in row] for row in weights.tolist()]}
