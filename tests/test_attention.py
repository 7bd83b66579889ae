"""`nmt attention`: the weights it shows are the softmax rows the model used, and its pictures are valid.

The weights are checked against a recomputation from each layer's own projections and inputs
(captured with forward hooks), softmax(Q K^T / sqrt(d_k)) written out here; and the recorded rows
times V, through W^O and the residual block, give exactly what the layer output.
"""

from __future__ import annotations

import json
import math
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conftest import assert_user_error, nmt
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD
from nmt_cli.evaluation.attention_maps import (
    attention_maps,
    figure_inches,
    lines_inches,
    recording,
    token_label,
)
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

VOCAB = 40
SMALL = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.1)


def _batch() -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """A random model in eval mode and a batch of two sentences of different lengths, right-padded."""
    torch.manual_seed(0)
    model = Transformer(SMALL, VOCAB).eval()
    src = torch.tensor([[5, 6, 7, 8, 9, EOS], [10, 11, EOS, PAD, PAD, PAD]])
    prev = torch.tensor([[BOS, 12, 13, 14, 15], [BOS, 16, 17, PAD, PAD]])
    return model, src, prev


def _inputs(model: Transformer, src: torch.Tensor, prev: torch.Tensor) -> dict[tuple[str, int], tuple]:
    """(query input, key input, mask, causal) of every attention layer, captured with forward hooks
    (post-norm: a sub-layer reads its block's input)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.encoder_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("memory", out))]
    for i, layer in enumerate(model.encoder):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(f"enc{i}", a[0])))
    for i, layer in enumerate(model.decoder):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(f"dec{i}", a[0])))
        hooks.append(layer.self_block.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(f"mid{i}", out)))
    with torch.no_grad():
        model(src, prev)
    for hook in hooks:
        hook.remove()
    keys_real = (src != PAD)[:, None, None, :]
    found = {("encoder", i): (seen[f"enc{i}"], seen[f"enc{i}"], keys_real, False)
             for i in range(len(model.encoder))}
    for i in range(len(model.decoder)):
        found[("decoder", i)] = (seen[f"dec{i}"], seen[f"dec{i}"], None, True)
        found[("cross", i)] = (seen[f"mid{i}"], seen["memory"], keys_real, False)
    return found


def _softmax_rows(attention: torch.nn.Module, x_q: torch.Tensor, x_kv: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k)) from the layer's stacked in_proj weights, head by head: (B, H, T, L)."""
    D, H = x_q.shape[-1], attention.heads
    w, b = attention.in_proj.weight, attention.in_proj.bias
    q = (x_q @ w[:D].T + b[:D]).unflatten(-1, (H, D // H)).transpose(1, 2)
    k = (x_kv @ w[D : 2 * D].T + b[D : 2 * D]).unflatten(-1, (H, D // H)).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D // H)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    if causal:
        T = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return scores.softmax(-1)


def _layer(model: Transformer, kind: str, i: int) -> torch.nn.Module:
    if kind == "encoder":
        return model.encoder[i].self_attn
    return model.decoder[i].self_attn if kind == "decoder" else model.decoder[i].cross_attn


def test_recorded_weights_are_the_softmax_rows_each_layer_uses() -> None:
    model, src, prev = _batch()
    _, maps = attention_maps(model, src, prev)
    inputs = _inputs(model, src, prev)
    assert set(maps) == set(inputs) == {(k, i) for k in ("encoder", "decoder", "cross") for i in range(2)}
    for key, weights in maps.items():
        x_q, x_kv, mask, causal = inputs[key]
        assert weights.shape == (2, SMALL.heads, x_q.shape[1], x_kv.shape[1]), key
        torch.testing.assert_close(weights, _softmax_rows(_layer(model, *key), x_q, x_kv, mask, causal),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-6, rtol=0)
    for kind in ("encoder", "cross"):  # the second source has 3 real tokens: its padding gets exactly 0
        assert all(maps[(kind, i)][1, :, :, 3:].eq(0).all() for i in range(2))
        assert all(maps[(kind, i)][1, :, :, :3].gt(0).all() for i in range(2))
    for i in range(2):  # decoder position t sees positions <= t only
        future = torch.ones(5, 5, dtype=torch.bool).triu(1)
        weights = maps[("decoder", i)]
        assert weights[:, :, future].eq(0).all() and weights[:, :, ~future].gt(0).all()


def test_recorded_rows_times_values_give_the_layer_output_exactly() -> None:
    """What the first encoder layer's attention block output, rebuilt from the recorded rows: the
    rows the layer multiplied V by, bit for bit (the CPU path in float32)."""
    model, src, prev = _batch()
    block_out = {}
    hook = model.encoder[0].attn_block.register_forward_hook(lambda m, a, out: block_out.setdefault("y", out))
    _, maps = attention_maps(model, src, prev)
    hook.remove()
    x = _inputs(model, src, prev)[("encoder", 0)][0]
    attention = model.encoder[0].self_attn
    _, _, v = attention.qkv(x)
    heads = maps[("encoder", 0)] @ v  # (B, H, S, K)
    y = attention.out_proj(heads.transpose(1, 2).reshape(x.shape))
    assert torch.equal(model.encoder[0].attn_block.norm(x + y), block_out["y"])


def test_recording_changes_nothing_and_ends_with_the_block() -> None:
    model, src, prev = _batch()
    with torch.no_grad():
        plain = model(src, prev)
    recorded, maps = attention_maps(model, src, prev)
    assert torch.equal(plain, recorded) and len(maps) == 6
    assert all(a.recorder is None for a in model.modules() if hasattr(a, "in_proj"))
    with pytest.raises(RuntimeError), recording(model):
        raise RuntimeError("a failure inside the block")
    assert all(a.recorder is None for a in model.modules() if hasattr(a, "in_proj"))


def test_token_labels() -> None:
    assert [token_label(s) for s in ["▁The", "ing", ".", "</s>", "<s>", "▁", "<unk>", "▁$5"]] == [
        "The", "##ing", ".", "<EOS>", "<BOS>", "␣", "<unk>", "$5"]


# -- the command --------------------------------------------------------------------------------

SOURCE = "red cat sings near the river"


def test_json_holds_the_model_weights_for_every_kind(tiny_trained_model: Path, tmp_path: Path) -> None:
    """The JSON of each kind against a recomputation from the model file; the target is the model's
    own beam-search translation, the one `nmt translate` gives."""
    model, dictionary, _ = model_file.load_model(tiny_trained_model)
    translation = nmt("translate", tiny_trained_model, input=SOURCE + "\n").stdout.strip()
    source = [*_pieces(tiny_trained_model, SOURCE), "</s>"]
    src = torch.tensor([[dictionary.index[s] for s in source]])
    for kind, layer in (("encoder", 2), ("decoder", 1), ("cross", 2)):
        out = tmp_path / f"{kind}.json"
        nmt("attention", tiny_trained_model, "--source", SOURCE, "--kind", kind, "--layer", layer,
            "--format", "json", "--out", out)
        doc = json.loads(out.read_text(encoding="utf-8"))
        assert (doc["kind"], doc["layer"], doc["layers"], doc["heads"]) == (kind, layer, 2, [1, 2, 3, 4])
        assert doc["target"] == translation and doc["target_from"] == "beam search"
        queries, keys = doc["query_tokens"], doc["key_tokens"]
        assert doc["query_labels"] == [token_label(s) for s in queries]
        assert doc["key_labels"] == [token_label(s) for s in keys]
        match kind:
            case "encoder":
                assert queries == keys == source
            case "decoder":  # keys: BOS and the target read; queries: the tokens predicted, EOS last
                assert keys[0] == "<s>" and keys[1:] == queries[:-1] and queries[-1] == "</s>"
            case "cross":
                assert keys == source and queries[-1] == "</s>"
        weights = torch.tensor(doc["weights"])
        assert weights.shape == (4, len(queries), len(keys))
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)
        if kind == "decoder":
            assert weights.triu(1).eq(0).all(), "a decoder position sees a later one"
        # the encoder ignores the target
        target = [dictionary.index[s] for s in queries[:-1]] if kind != "encoder" else []
        prev = torch.tensor([[BOS, *target]])
        x_q, x_kv, mask, causal = _inputs(model, src, prev)[(kind, layer - 1)]
        expected = _softmax_rows(_layer(model, kind, layer - 1), x_q, x_kv, mask, causal)[0]
        torch.testing.assert_close(weights, expected, atol=1e-5, rtol=1e-4)


def _pieces(path: Path, text: str) -> list[str]:
    import sentencepiece as spm

    _, _, sp_bytes = model_file.load_model(path)
    return spm.SentencePieceProcessor(model_proto=sp_bytes).encode(text, out_type=str)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_pictures_are_valid_png_and_svg(tiny_trained_model: Path, tmp_path: Path) -> None:
    import matplotlib.image

    target = "red cat sings"
    nmt("attention", tiny_trained_model, "--source", SOURCE, "--target", target, "--kind", "cross",
        "--dpi", 50, "--out", tmp_path / "grid.png")
    doc_out = tmp_path / "grid.json"
    nmt("attention", tiny_trained_model, "--source", SOURCE, "--target", target, "--kind", "cross",
        "--format", "json", "--out", doc_out)
    doc = json.loads(doc_out.read_text(encoding="utf-8"))
    assert doc["target"] == target and doc["target_from"] == "given"
    longest = max(len(s) for s in doc["query_labels"] + doc["key_labels"])
    title = f"Encoder-decoder attention, layer 2 of 2, all heads\nsource: {SOURCE}\ntarget (given): {target}"
    width, height = figure_inches(len(doc["query_tokens"]), len(doc["key_tokens"]), 4, longest, title)
    assert _png_size(tmp_path / "grid.png") == (int(width * 50), int(height * 50))  # matplotlib truncates
    pixels = matplotlib.image.imread(tmp_path / "grid.png")
    assert pixels.std() > 0.05, "the picture is blank"

    nmt("attention", tiny_trained_model, "--source", SOURCE, "--kind", "decoder", "--head", 2,
        "--out", tmp_path / "one.svg")
    root = ET.parse(tmp_path / "one.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"

    lines = tmp_path / "lines.png"  # the paper's style, the lines of one query token
    nmt("attention", tiny_trained_model, "--source", SOURCE, "--target", target, "--style", "lines",
        "--query", "sings", "--dpi", 50, "--out", lines)
    title = f"Encoder self-attention, layer 2 of 2, all heads, the attention of 'sings'\nsource: {SOURCE}\n" \
            f"target (given): {target}"
    width, height = lines_inches(len(doc["key_tokens"]), max(len(s) for s in doc["key_labels"]), title)
    assert _png_size(lines) == (int(width * 50), int(height * 50))
    assert matplotlib.image.imread(lines).std() > 0.05


def test_user_errors(tiny_trained_model: Path, tmp_path: Path) -> None:
    for args, needles in [
        (["--layer", "3"], ["--layer 3", "layers 1 to 2"]),
        (["--head", "5"], ["--head 5", "heads 1 to 4"]),
        (["--out", tmp_path / "a.jpg"], ["a.jpg", ".png or .svg"]),
        (["--source", " "], ["--source is empty"]),
        (["--kind", "both"], ["kind", "encoder, decoder, cross"]),
        (["--query", "cat"], ["--query", "--style lines"]),
        (["--style", "lines", "--query", "dog"],
         ["--query 'dog' is not one of the query tokens: red c ##at sings"]),
    ]:
        base = {"--source": SOURCE, "--out": tmp_path / "a.png"}
        for flag, value in zip(args[::2], args[1::2], strict=True):
            base[flag] = value
        proc = nmt("attention", tiny_trained_model, *[x for kv in base.items() for x in kv], check=False)
        assert_user_error(proc, *needles)
    missing = nmt("attention", tmp_path / "none.pt", "--source", SOURCE, "--out", tmp_path / "a.png",
                  check=False)
    assert_user_error(missing, "none.pt", "does not exist")
    assert not (tmp_path / "a.png").exists()
