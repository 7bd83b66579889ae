"""`nmt import fairseq` on the settings the two real checkpoints do not cover, built here in fairseq's
checkpoint layout with random weights: no sharing at all with separate dictionaries, sinusoidal
pre-norm, and a `transformer_vaswani_wmt_en_de_big`-shaped model (its widths, heads and dropout; one
layer a side instead of six, to stay small). The imported model's logits are compared with fairseq's
forward equations written out here from fairseq's code, on fairseq's own ids. Also: a hostile
checkpoint is refused and runs nothing; unsupported settings are refused by name.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_user_error, nmt
from nmt_cli.config.convert import FairseqImportConfig
from nmt_cli.data.dataset import BOS
from nmt_cli.errors import NmtError
from nmt_cli.model import fairseq
from nmt_cli.model import file as model_file

FS_EOS = 2  # fairseq: <s> 0, <pad> 1, </s> 2, <unk> 3

VARIANTS = {
    "no sharing, separate dictionaries": dict(
        arch="transformer", encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=4,
        encoder_layers=2, decoder_layers=1, share_all_embeddings=False,
        share_decoder_input_output_embed=False, encoder_normalize_before=False, encoder_learned_pos=False,
        joined=False),
    "sinusoidal pre-norm": dict(
        arch="transformer_iwslt_de_en", encoder_embed_dim=32, encoder_ffn_embed_dim=48,
        encoder_attention_heads=2, encoder_layers=1, decoder_layers=2, share_all_embeddings=False,
        share_decoder_input_output_embed=True, encoder_normalize_before=True, encoder_learned_pos=False,
        joined=True),
    "vaswani big shape": dict(
        arch="transformer_vaswani_wmt_en_de_big", encoder_embed_dim=1024, encoder_ffn_embed_dim=4096,
        encoder_attention_heads=16, encoder_layers=1, decoder_layers=1, dropout=0.3,
        share_all_embeddings=True, share_decoder_input_output_embed=True, encoder_normalize_before=False,
        encoder_learned_pos=False, joined=True),
}


def _settings(variant: dict) -> dict:
    """The Namespace fairseq saves: every decoder setting spelled out, as its architectures do."""
    args = {k: v for k, v in variant.items() if k != "joined"}
    for enc in ("embed_dim", "ffn_embed_dim", "attention_heads", "normalize_before", "learned_pos"):
        args[f"decoder_{enc}"] = args[f"encoder_{enc}"]
    args.update(decoder_output_dim=args["encoder_embed_dim"], decoder_input_dim=args["encoder_embed_dim"],
                activation_fn="relu", max_source_positions=64, max_target_positions=64, _name=args["arch"])
    return args


def _weights(args: dict, src_vocab: int, tgt_vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under fairseq's names and shapes."""
    g = torch.Generator().manual_seed(seed)
    D, Fw = args["encoder_embed_dim"], args["encoder_ffn_embed_dim"]

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"encoder.embed_tokens.weight": rand(src_vocab, D), "encoder.version": torch.tensor([3.0])}
    w["decoder.embed_tokens.weight"] = (w["encoder.embed_tokens.weight"] if args["share_all_embeddings"]
                                        else rand(tgt_vocab, D))
    shared_output = args["share_decoder_input_output_embed"]
    w["decoder.output_projection.weight"] = (w["decoder.embed_tokens.weight"] if shared_output
                                             else rand(tgt_vocab, D))
    for side in ("encoder", "decoder"):
        if args["encoder_learned_pos"]:
            w[f"{side}.embed_positions.weight"] = rand(64 + 2, D)
        else:
            w[f"{side}.embed_positions._float_tensor"] = torch.zeros(1)
        attentions = ["self_attn"] + (["encoder_attn"] if side == "decoder" else [])
        for i in range(args[f"{side}_layers"]):
            p = f"{side}.layers.{i}"
            for attn in attentions:
                for proj in ("q", "k", "v", "out"):
                    w[f"{p}.{attn}.{proj}_proj.weight"] = rand(D, D, scale=D**-0.5)
                    w[f"{p}.{attn}.{proj}_proj.bias"] = rand(D, scale=0.1)
            w[f"{p}.fc1.weight"], w[f"{p}.fc1.bias"] = rand(Fw, D, scale=D**-0.5), rand(Fw, scale=0.1)
            w[f"{p}.fc2.weight"], w[f"{p}.fc2.bias"] = rand(D, Fw, scale=Fw**-0.5), rand(D, scale=0.1)
            for norm in [f"{a}_layer_norm" for a in attentions] + ["final_layer_norm"]:
                w[f"{p}.{norm}.weight"], w[f"{p}.{norm}.bias"] = 1 + rand(D, scale=0.1), rand(D, scale=0.1)
        if args["encoder_normalize_before"]:
            w[f"{side}.layer_norm.weight"], w[f"{side}.layer_norm.bias"] = 1 + rand(D, scale=0.1), rand(D)
    return w


# -- fairseq's forward, written out from fairseq/models/transformer and fairseq/modules --------------


def _positions(w: dict, args: dict, side: str, length: int) -> torch.Tensor:
    positions = torch.arange(length) + 2  # make_positions: padding_idx + 1 onwards
    if args["encoder_learned_pos"]:
        return w[f"{side}.embed_positions.weight"][positions]
    half = args["encoder_embed_dim"] // 2  # SinusoidalPositionalEmbedding.get_embedding
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = positions.float()[:, None] * freq[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def _mha(w: dict, p: str, query: torch.Tensor, key: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    D = query.shape[-1]
    head = D // heads
    q = F.linear(query, w[f"{p}.q_proj.weight"], w[f"{p}.q_proj.bias"]) * head**-0.5
    k = F.linear(key, w[f"{p}.k_proj.weight"], w[f"{p}.k_proj.bias"])
    v = F.linear(key, w[f"{p}.v_proj.weight"], w[f"{p}.v_proj.bias"])
    q, k, v = (t.view(len(t), heads, head).transpose(0, 1) for t in (q, k, v))  # (H, L, head)
    scores = q @ k.transpose(1, 2)
    if causal:
        scores = scores + torch.triu(torch.full(scores.shape[1:], float("-inf")), 1)
    out = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(len(query), D)
    return F.linear(out, w[f"{p}.out_proj.weight"], w[f"{p}.out_proj.bias"])


def _ln(w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{p}.weight"], w[f"{p}.bias"], eps=1e-5)


def _sublayer(w: dict, args: dict, norm: str, x: torch.Tensor, f) -> torch.Tensor:
    if args["encoder_normalize_before"]:
        return x + f(_ln(w, norm, x))
    return _ln(w, norm, x + f(x))


def fairseq_logits(w: dict, args: dict, src: list[int], prev: list[int]) -> torch.Tensor:
    """fairseq's decoder output (T, V_tgt) for one source and decoder input, in fairseq's ids."""
    D, H = args["encoder_embed_dim"], args["encoder_attention_heads"]
    ffn = lambda p: lambda h: F.linear(F.relu(F.linear(h, w[f"{p}.fc1.weight"], w[f"{p}.fc1.bias"])),  # noqa: E731
                                       w[f"{p}.fc2.weight"], w[f"{p}.fc2.bias"])
    x = math.sqrt(D) * w["encoder.embed_tokens.weight"][src] + _positions(w, args, "encoder", len(src))
    for i in range(args["encoder_layers"]):
        p = f"encoder.layers.{i}"
        x = _sublayer(w, args, f"{p}.self_attn_layer_norm", x,
                      lambda h, p=p: _mha(w, f"{p}.self_attn", h, h, H, False))
        x = _sublayer(w, args, f"{p}.final_layer_norm", x, ffn(p))
    memory = _ln(w, "encoder.layer_norm", x) if args["encoder_normalize_before"] else x
    y = math.sqrt(D) * w["decoder.embed_tokens.weight"][prev] + _positions(w, args, "decoder", len(prev))
    for i in range(args["decoder_layers"]):
        p = f"decoder.layers.{i}"
        y = _sublayer(w, args, f"{p}.self_attn_layer_norm", y,
                      lambda h, p=p: _mha(w, f"{p}.self_attn", h, h, H, True))
        y = _sublayer(w, args, f"{p}.encoder_attn_layer_norm", y,
                      lambda h, p=p: _mha(w, f"{p}.encoder_attn", h, memory, H, False))
        y = _sublayer(w, args, f"{p}.final_layer_norm", y, ffn(p))
    if args["encoder_normalize_before"]:
        y = _ln(w, "decoder.layer_norm", y)
    return F.linear(y, w["decoder.output_projection.weight"])


# -- building and importing checkpoints ---------------------------------------------------------------


def _write_dict(path: Path, symbols: list[str]) -> Path:
    path.write_text("".join(f"{s} {100 - i}\n" for i, s in enumerate(symbols)), encoding="utf-8")
    return path


def _checkpoint(folder: Path, variant: dict, seed: int = 0, **extra) -> tuple[Path, dict, list, list]:
    """A fairseq checkpoint file of `variant` with its dictionaries and a sentencepiece model."""
    args = {**_settings(variant), **extra}
    tgt = [f"de{i}" for i in range(20)] + [f"both{i}" for i in range(8)]
    src = tgt if variant["joined"] else [f"both{i}" for i in range(8)] + [f"en{i}" for i in range(13)]
    w = _weights(args, len(src) + 4, len(tgt) + 4, seed)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"args": None, "cfg": {"model": argparse.Namespace(**args), "task": {"_name": "translation"}},
                "model": w, "optimizer_history": [], "extra_state": {}}, folder / "checkpoint.pt")
    _write_dict(folder / "dict.en.txt", src)
    _write_dict(folder / "dict.de.txt", tgt)
    (folder / "spm.model").write_bytes(b"not read by these tests")
    return folder / "checkpoint.pt", args, src, tgt


def _import(checkpoint: Path, **options) -> Path:
    out = checkpoint.with_name("imported.pt")
    fairseq.run(FairseqImportConfig(checkpoint=checkpoint, out=out, **options))
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_imported_logits_equal_fairseqs_equations(name: str, tmp_path: Path) -> None:
    checkpoint, args, src_syms, tgt_syms = _checkpoint(tmp_path, VARIANTS[name])
    model, dictionary, _ = model_file.load_model(_import(checkpoint))
    w = torch.load(checkpoint, weights_only=False)["model"]
    g = torch.Generator().manual_seed(1)
    source = [src_syms[i] for i in torch.randint(len(src_syms), (7,), generator=g)]
    target = [tgt_syms[i] for i in torch.randint(len(tgt_syms), (6,), generator=g)]
    fs_src = {s: i + 4 for i, s in enumerate(src_syms)}
    fs_tgt = {s: i + 4 for i, s in enumerate(tgt_syms)}
    with torch.no_grad():
        expected = fairseq_logits(w, args, [fs_src[s] for s in source] + [FS_EOS],
                                  [FS_EOS] + [fs_tgt[s] for s in target])
        ours = model(torch.tensor([dictionary.encode(source) + [2]]),
                     torch.tensor([[BOS] + dictionary.encode(target)]))[0]
    # column j of ours is nmt symbol j: fairseq's id of that symbol (specials: <s> 0 <-> <pad> 1)
    assert ours.shape[-1] == len(tgt_syms) + 4
    columns = [1, 0, 2, 3] + [fs_tgt[s] for s in dictionary.symbols[4 : ours.shape[-1]]]
    torch.testing.assert_close(ours, expected[:, columns], atol=2e-4, rtol=1e-4)


def test_a_source_word_missing_from_the_source_dictionary_reads_as_unknown(tmp_path: Path) -> None:
    """With separate dictionaries a target-only symbol in the source is fairseq's <unk> there."""
    checkpoint, args, src_syms, _ = _checkpoint(tmp_path, VARIANTS["no sharing, separate dictionaries"])
    model, dictionary, _ = model_file.load_model(_import(checkpoint))
    with torch.no_grad():
        unknown = model.encode(torch.tensor([dictionary.encode(["de3", "both1"]) + [2]])).memory
        unk = model.encode(torch.tensor([[3] + dictionary.encode(["both1"]) + [2]])).memory
    torch.testing.assert_close(unknown, unk)


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    checkpoint, *_ = _checkpoint(tmp_path, VARIANTS["sinusoidal pre-norm"])
    state = torch.load(checkpoint, weights_only=False)
    marker = tmp_path / "ran"
    state["cfg"]["model"].arch = _RunsACommand(marker)  # fairseq's layout, one setting a command
    torch.save(state, checkpoint)
    proc = nmt("import", "fairseq", checkpoint, "--out", tmp_path / "out.pt", check=False)
    assert_user_error(proc, str(checkpoint), "refused", "nothing in it was run", "system")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("setting, value, named", [
    ("arch", "transformer_lm", "architecture 'transformer_lm'"),
    ("encoder_layerdrop", 0.2, "encoder_layerdrop=0.2"),
    ("adaptive_softmax_cutoff", "5000,20000", "adaptive_softmax_cutoff"),
    ("activation_fn", "gelu", "activation_fn='gelu'"),
    ("decoder_ffn_embed_dim", 96, "decoder_ffn_embed_dim=96"),
    ("layernorm_embedding", True, "layernorm_embedding=True"),
])
def test_unsupported_settings_are_refused_by_name(setting: str, value, named: str, tmp_path: Path) -> None:
    checkpoint, *_ = _checkpoint(tmp_path, VARIANTS["sinusoidal pre-norm"], **{setting: value})
    with pytest.raises(NmtError, match=named.replace("(", r"\(")) as error:
        _import(checkpoint)
    assert str(checkpoint) in str(error.value)


def test_dictionaries_are_found_beside_the_checkpoint_by_size(tmp_path: Path) -> None:
    checkpoint, *_ = _checkpoint(tmp_path, VARIANTS["no sharing, separate dictionaries"])
    state = model_file.load(_import(checkpoint))
    assert state["dictionary"]["symbols"][4:6] == ["de0", "de1"]  # dict.de.txt is the decoder's
    assert state["model_config"]["output_vocab"] == 4 + 28
