"""The Transformer's shape (arXiv 1706.03762, section 3 and table 3) and its named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nmt_cli.config.core import opt
from nmt_cli.errors import NmtError


@dataclass
class ModelConfig:
    encoder_layers: int = opt(6, "encoder layers N", at_least=1)
    decoder_layers: int = opt(6, "decoder layers N", at_least=1)
    d_model: int = opt(512, "model width d_model", at_least=2)
    d_ff: int = opt(2048, "feed-forward inner width d_ff", at_least=1)
    heads: int = opt(8, "attention heads h", at_least=1)
    d_k: int = opt(0, "per-head query and key width d_k (0: d_model / h; table 3 rows A, B)", at_least=0)
    d_v: int = opt(0, "per-head value width d_v (0: d_model / h; table 3 row A)", at_least=0)
    dropout: float = opt(0.1, "P_drop on every sub-layer output and on embedding+position sums",
                         at_least=0, below=1)
    attention_dropout: float = opt(0.0, "dropout on attention weights (not in the paper)", at_least=0,
                                   below=1)
    activation_dropout: float = opt(0.0, "dropout after the feed-forward ReLU (not in the paper)", at_least=0,
                                    below=1)
    max_positions: int = opt(1024, "longest source or target (in tokens, with EOS) the model accepts",
                             at_least=2)
    norm: Literal["post", "pre"] = opt("post", "post-norm (paper) or pre-norm residual blocks")
    positions: Literal["sinusoidal", "learned", "fairseq_sinusoidal"] = opt(
        "sinusoidal", "position encodings: the paper's sinusoids (section 3.5), a trained table of "
        "max_positions rows (table 3 row E), or fairseq's sinusoids (tensor2tensor's variant: "
        "frequencies 10000^(-i/(D/2-1)), the sin half then the cos half, positions counted from 2)")
    # The settings below let a model imported from fairseq (`nmt import fairseq`) be expressed exactly;
    # their defaults are the paper's model, so every model file written before them loads as it was.
    share_embeddings: Literal["all", "target", "none"] = opt(
        "all", "which embedding matrices are one: source, target and output (section 3.4), the target "
        "input and output only, or none")
    shared_positions: bool = opt(True, "learned positions: one table for source and target (false: one each)")
    output_vocab: int = opt(
        0, "the first N dictionary entries are the target vocabulary, the only ones the decoder scores "
        "(0: all); the rest are source-only symbols of a model with separate dictionaries", at_least=0)
    decoder_start: Literal["bos", "eos", "pad"] = opt(
        "bos", "the token the decoder reads at the first position: BOS, EOS as in fairseq, or PAD as in "
        "MarianMT (decoder_start_token_id)")
    # The settings below let a MarianMT model (`nmt import huggingface`) be expressed exactly; their
    # defaults are the paper's model, as above.
    activation: Literal["relu", "swish", "gelu"] = opt(
        "relu", "the feed-forward activation: max(0, x) (section 3.3), swish x * sigmoid(x) as OPUS-MT's "
        "models use, or gelu (the exact erf form)")
    output_bias: bool = opt(False, "a bias on the output logits (MarianMT's final_logits_bias)")

    def __post_init__(self) -> None:
        """What the Transformer's shapes need: checked here, so that a setting from YAML or --set, or
        the config inside a model file, is refused with a message instead of failing inside torch."""
        if self.positions != "learned" and self.d_model % 2:
            raise NmtError(f"model.d_model ({self.d_model}) must be even for sinusoidal positions "
                           "(or set model.positions=learned)")
        if 0 < self.output_vocab < 4:
            raise NmtError(f"model.output_vocab ({self.output_vocab}) must be 0 or hold the 4 special "
                           "symbols")
        if self.heads > 0 and self.d_model % self.heads and not (self.d_k and self.d_v):
            raise NmtError(f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads}), "
                           "or model.d_k and model.d_v set")

    @property
    def head_widths(self) -> tuple[int, int]:
        """(d_k, d_v) of each head: as set, or d_model / h (section 3.2.2)."""
        return self.d_k or self.d_model // self.heads, self.d_v or self.d_model // self.heads


ARCHS: dict[str, ModelConfig] = {
    "transformer_base": ModelConfig(),
    "transformer_big": ModelConfig(d_model=1024, d_ff=4096, heads=16, dropout=0.3),
    "transformer_small": ModelConfig(encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, heads=4),
    "transformer_tiny": ModelConfig(encoder_layers=2, decoder_layers=2, d_model=128, d_ff=512, heads=4),
    # Section 6.3, constituency parsing: 4 layers, d_model 1024, "all other parameters unchanged from
    # the English-to-German base" (d_ff 2048, h 8). Dropout (residual and attention) was chosen on
    # section 22 without the value given; 0.2 both is tensor2tensor's transformer_parsing_base.
    "transformer_parse": ModelConfig(encoder_layers=4, decoder_layers=4, d_model=1024, d_ff=2048, heads=8,
                                     dropout=0.2, attention_dropout=0.2),
}
Arch = Literal["transformer_base", "transformer_big", "transformer_small", "transformer_tiny",
               "transformer_parse"]
