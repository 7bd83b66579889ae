"""`nmt attention`: what a trained model attends to in one sentence, as heatmaps or as JSON.

The model reads the source and, teacher-forced, the target: the one given with ``--target``, else
its own beam-search translation. While it runs, every attention layer hands its softmax rows to a
recorder (`recording`; `model/transformer.py` computes them only then). One kind of attention, one
layer and one head or all heads are drawn: as heatmaps, queries down and keys across, or with
``--style lines`` as in the paper's figures 3-5 (encoder self-attention of layer 5 of 6), queries
above keys, each pair joined by a line as opaque as its weight, one colour per head, ``--query``
picking one query token's lines. The model runs on the CPU in float32.

Positions and their labels. Encoder self-attention: the source pieces and EOS on both axes.
Decoder self-attention: the keys are the decoder's inputs (BOS, y1 .. yn); each query position is
labelled by the token it predicts (y1 .. yn, EOS), so position t reads keys 0 .. t. Cross
attention: the same queries over the source pieces and EOS. On the axes sentencepiece's word
marker ▁ is dropped, a piece inside a word is shown as ##piece (punctuation as it is), EOS and
BOS as <EOS> and <BOS>.

JSON layout (``--format json``), one object:
    {"model": path, "kind": "encoder" | "decoder" | "cross", "layer": L (1-based), "layers": N,
     "heads": [h, ...] (1-based), "source": text, "target": text, "target_from": "given" | "beam search",
     "query_tokens": [...], "key_tokens": [...],    # dictionary symbols: pieces with ▁, "<s>", "</s>"
     "query_labels": [...], "key_labels": [...],    # as drawn on the axes
     "weights": [[[w, ...], ...], ...]}             # weights[i][q][k]: head heads[i], query q, key k
Each row weights[i][q] sums to 1 (float32 rounding); a key a query may not see has weight 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nmt_cli.artifacts import atomic_write_text
from nmt_cli.config.evaluation import AttentionConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.data.dataset import BOS, EOS, Dictionary
from nmt_cli.errors import NmtError, shown
from nmt_cli.evaluation.plot import new_figure, picture_format, save_figure
from nmt_cli.inference.search import translate_ids
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

Maps = dict[tuple[str, int], list[Tensor]]  # (kind, 0-based layer) -> softmax (B, H, T, L) of each call
KIND_TITLES = {"encoder": "Encoder self-attention", "decoder": "Decoder self-attention",
               "cross": "Encoder-decoder attention"}


@contextlib.contextmanager
def recording(model: Transformer) -> Iterator[Maps]:
    """While active, every attention layer of `model` adds the softmax rows it applies to the
    mapping yielded: maps[(kind, layer)] holds one (B, H, T, L) tensor per call of that layer."""
    maps: Maps = {}
    layers = [("encoder", i, layer.self_attn) for i, layer in enumerate(model.encoder)]
    layers += [("decoder", i, layer.self_attn) for i, layer in enumerate(model.decoder)]
    layers += [("cross", i, layer.cross_attn) for i, layer in enumerate(model.decoder)]
    try:
        for kind, i, attention in layers:
            attention.recorder = lambda weights, key=(kind, i): maps.setdefault(key, []).append(
                weights.detach())
        yield maps
    finally:
        for _, _, attention in layers:
            attention.recorder = None


@torch.no_grad()
def attention_maps(model: Transformer, src: Tensor,
                   prev: Tensor) -> tuple[Tensor, dict[tuple[str, int], Tensor]]:
    """One teacher-forced forward pass of src (B, S) and prev (B, T) = BOS + target: its logits
    (B, T, V) and every layer's softmax rows, {(kind, 0-based layer): (B, H, T or S, S or T)}."""
    with recording(model) as maps:
        logits = model(src, prev)
    assert all(len(calls) == 1 for calls in maps.values())
    return logits, {key: calls[0] for key, calls in maps.items()}


def token_label(symbol: str) -> str:
    """How a dictionary symbol is shown on an axis (see the module docstring)."""
    match symbol:
        case "</s>":
            return "<EOS>"
        case "<s>":
            return "<BOS>"
        case "▁":
            return "␣"  # a word marker alone: sentencepiece puts it before some punctuation
    if symbol.startswith("<") and symbol.endswith(">"):
        return symbol
    if symbol.startswith("▁"):
        return symbol[1:]
    # "##" marks a piece inside a word, not punctuation
    return f"##{symbol}" if symbol[0].isalnum() else symbol


# -- the sentence -------------------------------------------------------------------------------


class Sentence(NamedTuple):
    source: str
    target: str
    target_from: str  # "given" or "beam search"
    src: list[int]  # source ids, EOS last
    prev: list[int]  # BOS + target ids: the decoder's inputs
    predicted: list[int]  # target ids + EOS: what each decoder position predicts


def prepare_sentence(model: Transformer, dictionary: Dictionary, sp: Any, cfg: AttentionConfig) -> Sentence:
    """Source ids, and target ids from --target or from beam search."""
    if not cfg.source.strip():
        raise NmtError("--source is empty: give the sentence to look at")
    src = [*_ids(dictionary, sp, cfg.source, "--source", model.cfg.max_positions), EOS]
    if cfg.target is not None:
        target, target_from = _ids(dictionary, sp, cfg.target, "--target", model.cfg.max_positions), "given"
    else:
        if cfg.beam < 1:
            raise NmtError(f"--beam must be at least 1, got {cfg.beam}")
        search = TranslateConfig(model=cfg.model, beam=cfg.beam)
        target, target_from = translate_ids(model, [src], search)[0][0].tokens, "beam search"
    text = cfg.target if cfg.target is not None else sp.decode(dictionary.decode(target))
    return Sentence(cfg.source, text, target_from, src, [BOS, *target], [*target, EOS])


def _ids(dictionary: Dictionary, sp: Any, text: str, option: str, max_positions: int) -> list[int]:
    ids = dictionary.encode(sp.encode(text, out_type=str))
    if len(ids) + 1 > max_positions:
        raise NmtError(f"{option} has {len(ids)} pieces; the model takes at most {max_positions - 1} "
                       "(its max_positions, with EOS): give a shorter sentence")
    return ids


def tokens_of(kind: str, sentence: Sentence, dictionary: Dictionary) -> tuple[list[str], list[str]]:
    """(query symbols, key symbols) of one kind of attention (see the module docstring)."""
    source = [dictionary.symbols[i] for i in sentence.src]
    match kind:
        case "encoder":
            return source, source
        case "decoder":
            return ([dictionary.symbols[i] for i in sentence.predicted],
                    [dictionary.symbols[i] for i in sentence.prev])
        case _:
            return [dictionary.symbols[i] for i in sentence.predicted], source


def select(maps: dict[tuple[str, int], Tensor], cfg: AttentionConfig,
           layers: int) -> tuple[int, list[int], Tensor]:
    """(1-based layer, 1-based heads, weights (heads, T, L)) of the first sentence, as asked for."""
    layer = cfg.layer if cfg.layer != 0 else layers
    if not 1 <= layer <= layers:
        raise NmtError(f"--layer {cfg.layer}: the model's {cfg.kind} side has layers 1 to {layers} "
                       "(0: the last)")
    weights = maps[(cfg.kind, layer - 1)][0]  # (H, T, L)
    heads = weights.shape[0]
    if not 0 <= cfg.head <= heads:
        raise NmtError(f"--head {cfg.head}: the model has heads 1 to {heads} (0: all of them)")
    chosen = list(range(1, heads + 1)) if cfg.head == 0 else [cfg.head]
    return layer, chosen, weights[[h - 1 for h in chosen]]


# -- drawing ------------------------------------------------------------------------------------


def grid_shape(heads: int) -> tuple[int, int]:
    """(rows, columns) of the panels: 4 heads 2 x 2, 8 heads 2 x 4, 16 heads 4 x 4."""
    rows = max(int(math.sqrt(heads)), 1)
    return rows, math.ceil(heads / rows)


def cell_inches(queries: int, keys: int, heads: int) -> float:
    """The side of one heatmap cell: large enough for its 8-point label, smaller when a grid of
    long sentences would pass ~30 inches (then only --head makes it readable)."""
    rows, cols = grid_shape(heads)
    size = 0.3 if heads == 1 else 0.24
    return max(min(size, 30 / (cols * keys), 30 / (rows * queries)), 0.08)


def figure_inches(queries: int, keys: int, heads: int, longest_label: int, title: str) -> tuple[float, float]:
    """The figure's (width, height): the panels, their token labels, the colour bar, and the title
    (12-point lines of `title`, ~0.1 inch a character)."""
    rows, cols = grid_shape(heads)
    cell = cell_inches(queries, keys, heads)
    label = 0.3 + 0.075 * longest_label * min(cell / 0.24, 1)  # 8-point characters beside the panel
    width = cols * max(keys * cell, 1.5) + (cols - 1) * 0.3 + label + 1.6
    height = rows * max(queries * cell, 1.5) + (rows - 1) * 0.4 + label + 1.5
    return round(max(width, _title_inches(title)), 2), round(height, 2)


def _title_inches(title: str) -> float:
    return 0.1 * max(len(line) for line in title.split("\n")) + 0.6


def draw(weights: Tensor, heads: list[int], queries: list[str], keys: list[str], title: str,
         axis_names: tuple[str, str]) -> Any:
    """Heatmaps of weights (heads, T, L) on a grid, one per head, tokens on the axes."""
    rows, cols = grid_shape(len(heads))
    longest = max(len(s) for s in [*queries, *keys])
    figure = new_figure(*figure_inches(len(queries), len(keys), len(heads), longest, title))
    axes = figure.subplots(rows, cols, sharex=True, sharey=True, squeeze=False).flatten()
    font = max(min(8.0, cell_inches(len(queries), len(keys), len(heads)) * 33), 4.0)
    top = float(weights.max())
    for ax, head, panel in zip(axes, heads, weights, strict=False):
        image = ax.imshow(panel.numpy(), cmap="Blues", vmin=0.0, vmax=top, aspect="equal",
                          interpolation="nearest")
        if len(heads) > 1:
            ax.set_title(f"head {head}", fontsize=10)
        ax.set_xticks(range(len(keys)), [_plain(k) for k in keys], rotation=90, fontsize=font)
        ax.set_yticks(range(len(queries)), [_plain(q) for q in queries], fontsize=font)
        ax.tick_params(length=0, labelbottom=ax.get_subplotspec().is_last_row(),
                       labelleft=ax.get_subplotspec().is_first_col())
    for ax in axes[len(heads):]:
        ax.set_axis_off()
    figure.colorbar(image, ax=axes.tolist(), shrink=0.8, label="attention weight")
    if len(heads) == 1:  # beside the panel, which a long title can leave narrower than the figure
        axes[0].set_xlabel(axis_names[1], fontsize=10)
        axes[0].set_ylabel(axis_names[0], fontsize=10)
    else:
        figure.supxlabel(axis_names[1], fontsize=10)
        figure.supylabel(axis_names[0], fontsize=10)
    figure.suptitle(_plain(title), fontsize=12)
    return figure


def lines_inches(tokens: int, longest_label: int, title: str) -> tuple[float, float]:
    """The (width, height) of a lines figure over the longer side's `tokens`."""
    label = 0.3 + 0.075 * longest_label
    return round(max(tokens * 0.35 + 2.0, _title_inches(title)), 2), round(2 * label + 3.4, 2)


def draw_lines(weights: Tensor, heads: list[int], queries: list[str], keys: list[str], title: str,
               only: int | None) -> Any:
    """The paper's figures 3-5: queries on top, keys below, a line from each query to each key as
    opaque as its weight (lighter than 1% left out), one colour per head, the heads' lines side by
    side; `only`: one query's lines."""
    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D

    tokens = max(len(queries), len(keys))
    figure = new_figure(*lines_inches(tokens, max(len(s) for s in [*queries, *keys]), title))
    ax = figure.subplots()
    x_query = [(tokens - len(queries)) / 2 + i for i in range(len(queries))]  # the shorter side centred
    x_key = [(tokens - len(keys)) / 2 + j for j in range(len(keys))]
    colors = [f"C{i % 10}" if len(heads) <= 10 else to_rgba("tab20", i % 20) for i in range(len(heads))]
    rows = range(len(queries)) if only is None else [only]
    for h, (color, panel) in enumerate(zip(colors, weights, strict=True)):
        r, g, b, _ = to_rgba(color)
        shift = 0.5 * ((h + 0.5) / len(heads) - 0.5)  # the heads side by side within a token's width
        segments, rgba = [], []
        for i in rows:
            for j, weight in enumerate(panel[i].tolist()):
                if weight >= 0.01:
                    segments.append([(x_query[i] + shift, 1.0), (x_key[j] + shift, 0.0)])
                    rgba.append((r, g, b, min(weight, 1.0)))
        ax.add_collection(LineCollection(segments, colors=rgba, linewidths=2.5 if only is not None else 1.8))
    ax.set_xlim(-0.6, tokens - 0.4)
    ax.set_ylim(-0.02, 1.02)
    _token_axes(ax, x_query, queries, x_key, keys, only)
    handles = [Line2D([], [], color=c, linewidth=3, label=f"head {h}")
               for c, h in zip(colors, heads, strict=True)]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(heads), 8), frameon=False,
                  fontsize=9)
    figure.suptitle(_plain(title), fontsize=12)
    return figure


def _token_axes(ax: Any, x_query: list[float], queries: list[str], x_key: list[float], keys: list[str],
                only: int | None) -> None:
    """Keys as labels below the lines, queries above (the chosen one in bold), no frame."""
    ax.set_xticks(x_key, [_plain(k) for k in keys], rotation=90, fontsize=9)
    top = ax.twiny()
    top.set_xlim(ax.get_xlim())
    top.set_xticks(x_query, [_plain(q) for q in queries], rotation=90, fontsize=9)
    if only is not None:
        top.get_xticklabels()[only].set_fontweight("bold")
    ax.set_yticks([0, 1], ["keys", "queries"], fontsize=10)
    for axis in (ax, top):
        axis.tick_params(length=0)
        for spine in axis.spines.values():
            spine.set_visible(False)


def query_position(labels: list[str], wanted: str) -> int:
    """The first query position labelled `wanted` (as drawn, or as the dictionary symbol)."""
    for i, label in enumerate(labels):
        if wanted == label:
            return i
    raise NmtError(f"--query {shown(wanted)} is not one of the query tokens: {' '.join(labels)}")


def _plain(text: str) -> str:
    """Text matplotlib shows as it is: a $ would start mathematical notation."""
    return text.replace("$", r"\$")


def axis_names(kind: str) -> tuple[str, str]:
    """(y, x) axis titles: queries, keys."""
    predicting = "query: target position (labelled by the token it predicts)"
    match kind:
        case "encoder":
            return "query: source token", "key: source token"
        case "decoder":
            return predicting, "key: target token read (the decoder's input)"
        case _:
            return predicting, "key: source token"


# -- the stage ----------------------------------------------------------------------------------


def load(cfg: AttentionConfig) -> tuple[Transformer, Dictionary, Any]:
    import sentencepiece as spm

    model, dictionary, spm_bytes = model_file.load_model(cfg.model, "cpu")
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(spm_bytes)
    except (RuntimeError, OSError) as e:
        raise NmtError(f"{cfg.model}: its sentencepiece model cannot be read ({e})") from None
    return model.float().eval(), dictionary, sp


def document(cfg: AttentionConfig, sentence: Sentence, layer: int, layers: int, heads: list[int],
             weights: Tensor, queries: list[str], keys: list[str]) -> dict[str, Any]:
    """The JSON object of the module docstring."""
    return {"model": str(cfg.model), "kind": cfg.kind, "layer": layer, "layers": layers, "heads": heads,
            "source": sentence.source, "target": sentence.target, "target_from": sentence.target_from,
            "query_tokens": queries, "key_tokens": keys,
            "query_labels": [token_label(q) for q in queries], "key_labels": [token_label(k) for k in keys],
            "weights": weights.tolist()}


def run(cfg: AttentionConfig) -> None:
    if cfg.format == "picture":
        picture_format(cfg.out)  # a wrong suffix fails before the model is loaded
    if cfg.query is not None and (cfg.style != "lines" or cfg.format != "picture"):
        raise NmtError("--query picks the lines of one query token: use it with --style lines")
    model, dictionary, sp = load(cfg)
    sentence = prepare_sentence(model, dictionary, sp, cfg)
    _, maps = attention_maps(model, torch.tensor([sentence.src]), torch.tensor([sentence.prev]))
    layers = len(model.encoder) if cfg.kind == "encoder" else len(model.decoder)
    layer, heads, weights = select(maps, cfg, layers)
    queries, keys = tokens_of(cfg.kind, sentence, dictionary)
    if cfg.format == "json":
        doc = document(cfg, sentence, layer, layers, heads, weights, queries, keys)
        atomic_write_text(cfg.out, json.dumps(doc, ensure_ascii=False) + "\n")
    else:
        save_figure(picture(cfg, sentence, layer, layers, heads, weights, queries, keys), cfg.out, cfg.dpi)
    print(f"attention: {KIND_TITLES[cfg.kind].lower()}, layer {layer}, {len(heads)} head(s), "
          f"{len(queries)} x {len(keys)} tokens -> {cfg.out}", file=sys.stderr)


def picture(cfg: AttentionConfig, sentence: Sentence, layer: int, layers: int, heads: list[int],
            weights: Tensor, queries: list[str], keys: list[str]) -> Any:
    query_labels, key_labels = [token_label(q) for q in queries], [token_label(k) for k in keys]
    head_text = "all heads" if cfg.head == 0 else f"head {cfg.head}"
    title = (f"{KIND_TITLES[cfg.kind]}, layer {layer} of {layers}, {head_text}\n"
             f"source: {sentence.source}\ntarget ({sentence.target_from}): {sentence.target}")
    if cfg.style == "heatmap":
        return draw(weights, heads, query_labels, key_labels, title, axis_names(cfg.kind))
    only = None if cfg.query is None else query_position(query_labels, cfg.query)
    if only is not None:
        title = title.replace(head_text, f"{head_text}, the attention of '{cfg.query}'")
    return draw_lines(weights, heads, query_labels, key_labels, title, only)
