"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017, section 3), with an
incremental decoder for search.

Shape legend for every tensor comment in the package:
    B batch, S source length, T target length, D model width (d_model), H heads, K query/key width
    of a head (d_k), K_v value width of a head (d_v; both D / H unless set), F feed-forward width
    (d_ff), V vocabulary.

The model knows nothing about distribution, checkpoints or search: `training` wraps it in DDP,
`inference.search` drives `start_decoding` / `decode_step` / `reorder`. How attention and dropout
run on each device is in `kernels.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model.kernels import (
    Dropout,
    attention,
    attention_weights,
    cached_attention,
    gathered,
    output_projection,
    relu,
)


class Cache:
    """The incremental decoder's state (`Transformer.start_decoding`, `decode_step`, `reorder`).

    `layers`, one dict per decoder layer: "memory_k"/"memory_v", the keys and values over the encoder
    output (B, H, S, K), one copy per sentence; "k"/"v", pools (P, H, K) of the self-attention's keys
    and values, one entry per row and position decoded, written once and never moved. `rows` (N, t + 1)
    says which entry holds each decoder row's keys and values at each position so far, its last column
    where this step writes. Keeping the surviving beams therefore copies that table of indices, not the
    keys and values: the copy of every row's cache at every step grew with the length and took 10-18%
    of a beam search's step (benchmarks/README.md, "int8").

    Rows may join while others decode (`join`: a server's search, `inference.search.Search`). The
    table is right-aligned, each row's newest entry in its last column; `valid` (N, t + 1), None while
    every row has every column, is False where a row had not joined yet, and attention leaves those
    columns out.
    """

    def __init__(self, layers: list[dict[str, Tensor]]) -> None:
        self.layers = layers
        self.rows: Tensor | None = None  # None until the first step
        self.valid: Tensor | None = None  # see the class docstring
        self.filled = 0  # pool entries written before this step's
        self.written = False  # whether this step's column has been written (decode_step ran)

    def start(self, n: int, device: torch.device) -> None:
        """Before the first step, of `n` rows."""
        self._open_column(torch.zeros(n, 0, dtype=torch.long, device=device))

    def advance(self, order: Tensor) -> None:
        """After a step: keep rows `order` (N') for the next one."""
        kept = self.rows.index_select(0, order)
        self.filled += self.rows.shape[0]
        self._open_column(kept, None if self.valid is None else self.valid.index_select(0, order))

    def join(self, n: int) -> None:
        """Before a step: `n` new rows, after the others, with nothing cached yet."""
        if self.rows is None:  # no step yet: the first one starts them all
            return
        kept, t = self.rows[:, :-1], self.rows.shape[1] - 1
        valid = torch.ones_like(kept, dtype=torch.bool) if self.valid is None else self.valid[:, :-1]
        self._open_column(torch.cat([kept, kept.new_zeros(n, t)]),
                          torch.cat([valid, valid.new_zeros(n, t)]))

    def trim(self, columns: int) -> None:
        """Keep only the last `columns` columns of the table: no row reads further back."""
        self.rows = self.rows[:, -columns:]
        if self.valid is not None:
            self.valid = self.valid[:, -columns:]
            if bool(self.valid.all()):
                self.valid = None

    def _open_column(self, kept: Tensor, valid: Tensor | None = None) -> None:
        """The rows' table of entries `kept` (N', t) (`valid` where they hold one, None: all), with a
        fresh column of entries to write."""
        n = kept.shape[0]
        if self.filled + n > self.layers[0]["k"].shape[0]:
            kept = self._make_room(kept, n)
        fresh = torch.arange(self.filled, self.filled + n, device=kept.device)
        self.rows, self.written = torch.cat([kept, fresh[:, None]], dim=1), False
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(n, 1)], dim=1)
        self.valid = valid

    def _make_room(self, kept: Tensor, n: int) -> Tensor:
        """New pools with room for `n` more entries and as many again (the table grows by doubling):
        holding only the entries `kept` (N', t) uses, renumbered, if they are fewer than those
        written (rows of finished sentences and of dropped beams leave entries nobody reads)."""
        compact = kept.numel() < self.filled
        size = kept.numel() if compact else self.filled
        for layer in self.layers:
            for name in ("k", "v"):
                old = layer[name]
                new = old.new_empty(2 * (size + n), *old.shape[1:])
                if compact:
                    torch.index_select(old, 0, kept.reshape(-1), out=new[:size])
                else:
                    new[:size] = old[:size]
                layer[name] = new
        self.filled = size
        if compact:
            kept = torch.arange(size, device=kept.device).view(kept.shape)
        return kept


class Slots(Protocol):
    """Where the decoder's N rows sit when the B sentences keep different numbers of live hypotheses:
    W slots a sentence, only the occupied ones with a row (the search's `inference.beams.Beams`)."""

    slot: Tensor  # (N,): the flat position b * W + w of each row

    def spread(self, rows: Tensor, fill: float) -> Tensor:
        """rows (N, ...) -> (B, W, ...): each row in its slot, `fill` in the empty ones."""
        ...


def sinusoids(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D))  (section 3.5)."""
    assert d_model % 2 == 0, "d_model must be even for sinusoidal positions"
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table.float()  # (L, D)


def fairseq_sinusoids(length: int, d_model: int, offset: int = 2) -> Tensor:
    """fairseq's sinusoids (tensor2tensor's variant, not section 3.5's): frequencies
    10000^(-i / (D/2 - 1)) for i < D/2, the sin of every frequency first, then the cos; position p of a
    sentence (from 0) reads the row of p + `offset` (fairseq counts from its padding index + 1 = 2)."""
    half = d_model // 2
    pos = torch.arange(offset, offset + length, dtype=torch.float32)[:, None]  # (L, 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = pos * freq[None, :]  # float32, as fairseq computes them
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # (L, D)


class Encoded(NamedTuple):
    memory: Tensor  # (B, S, D) encoder output
    mask: Tensor  # (B, 1, 1, S) True where the source token is real, for attention over it


class Attention(nn.Module):
    """Multi-head scaled dot-product attention: softmax(Q K^T / sqrt(K)) V per head, then W^O (3.2.2).
    Each head projects to d_k-wide queries and keys and d_v-wide values; the paper's d_k = d_v = D / H.

    `recorder`, None except while `nmt attention` looks (see `evaluation.attention_maps.recording`),
    is called with every softmax (B, H, T, L) this layer applies; the output is computed as always.
    """

    recorder: Callable[[Tensor], None] | None = None

    def __init__(self, cfg: ModelConfig, dropout: float) -> None:
        super().__init__()
        d_k, d_v = cfg.head_widths
        self.heads, self.dropout = cfg.heads, dropout
        self.widths = [cfg.heads * d_k, cfg.heads * d_k, cfg.heads * d_v]  # rows of W^Q, W^K, W^V
        self.in_proj = nn.Linear(cfg.d_model, sum(self.widths))  # W^Q, W^K, W^V of all heads, stacked
        self.out_proj = nn.Linear(cfg.heads * d_v, cfg.d_model)  # W^O
        for block in self.in_proj.weight.split(self.widths):
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def _in_proj(self, x: Tensor, rows: slice) -> Tensor:
        """x through the rows `rows` of W^Q, W^K, W^V stacked: a float layer's, or an int8 one's
        (`model/int8.py`), which takes the rows itself."""
        if isinstance(self.in_proj, nn.Linear):
            return F.linear(x, self.in_proj.weight[rows], self.in_proj.bias[rows])
        return self.in_proj(x, rows)

    def _heads(self, x: Tensor) -> Tensor:  # (B, L, H * width) -> (B, H, L, width)
        B, L, width = x.shape
        return x.view(B, L, self.heads, width // self.heads).transpose(1, 2)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries and keys (B, H, L, K) and values (B, H, L, K_v) of self-attention."""
        q, k, v = self._in_proj(x, slice(None)).split(self.widths, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def query(self, x: Tensor) -> Tensor:
        return self._heads(self._in_proj(x, slice(None, self.widths[0])))

    def keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (B, H, S, K) and values (B, H, S, K_v) over the encoder output: once per sentence."""
        kv = self._in_proj(memory, slice(self.widths[0], None))
        k, v = kv.split(self.widths[1:], dim=-1)
        return self._heads(k), self._heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
               cached: bool = False, rows: Tensor | None = None) -> Tensor:
        """(B, H, T, K) queries over (B, H, L, K) keys and (B, H, L, K_v) values -> (B, T, D). `mask`
        is True where allowed;
        `cached`: incremental decoding's queries over cached keys/values (`cached_attention`), with
        `rows` (B, L) those of pools (P, H, K) (`Cache`)."""
        if self.recorder is not None:
            self.recorder(attention_weights(q, k if rows is None else gathered(k, rows), mask, causal))
        if cached:
            return self._merge(cached_attention(q, k, v, mask, rows))
        return self._merge(attention(q, k, v, mask, causal, self.dropout if self.training else 0.0))

    def _merge(self, y: Tensor) -> Tensor:  # (B, H, T, K_v) -> W^O of the heads side by side (B, T, D)
        B, H, T, K = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * K))


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2  (section 3.3); with `activation: swish` or `gelu`,
    that function in place of max(0, .) (the MarianMT models of OPUS-MT use swish). `activation`
    None: fc1 applies it itself (int8's, `model/int8.py`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.activation: str | None = cfg.activation
        self.fc1, self.fc2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.activation_dropout = Dropout(cfg.activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        match self.activation:
            case "relu":
                h = relu(h)
            case "swish":
                h = F.silu(h)
            case "gelu":
                h = F.gelu(h)
        return self.fc2(self.activation_dropout(h))


class Residual(nn.Module):
    """One sub-layer with its residual connection: post-norm LayerNorm(x + Dropout(f(x))) as in the
    paper (section 5.4), or pre-norm x + Dropout(f(LayerNorm(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm, self.dropout = nn.LayerNorm(cfg.d_model), Dropout(cfg.dropout)
        self.pre_norm = cfg.norm == "pre"

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn, self.ffn = Attention(cfg, cfg.attention_dropout), FeedForward(cfg)
        self.attn_block, self.ffn_block = Residual(cfg), Residual(cfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # (B, S, D), (B, 1, 1, S) -> (B, S, D)
        x = self.attn_block(x, lambda h: self.self_attn.attend(*self.self_attn.qkv(h), mask=mask))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.attention_dropout)
        self.cross_attn = Attention(cfg, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.self_block, self.cross_block, self.ffn_block = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(self, x: Tensor, enc: Encoded, cache: dict[str, Tensor] | None,
                beams: Slots | None = None, rows: Tensor | None = None, filled: int = 0,
                valid: Tensor | None = None) -> Tensor:
        """x (B, T, D) -> (B, T, D). With a cache (one layer's of `Cache`, with its `rows`, `filled`
        and `valid`), x is the newest position only (T = 1)."""
        x = self.self_block(x, lambda h: self._self_attention(h, cache, rows, filled, valid))
        x = self.cross_block(x, lambda h: self._cross_attention(h, enc, cache, beams))
        return self.ffn_block(x, self.ffn)

    def _self_attention(self, h: Tensor, cache: dict[str, Tensor] | None, rows: Tensor | None,
                        filled: int, valid: Tensor | None) -> Tensor:
        q, k, v = self.self_attn.qkv(h)
        if cache is None:  # whole target at once: position t sees positions <= t (causal mask)
            return self.self_attn.attend(q, k, v, causal=True)
        # One new position, written to its pool entries (rows[:, -1], the next len(rows) after the
        # `filled` ones): it sees everything cached so far, all of it unless rows joined late (`valid`).
        cache["k"][filled : filled + len(rows)] = k[:, :, 0]
        cache["v"][filled : filled + len(rows)] = v[:, :, 0]
        mask = None if valid is None else valid[:, None, None, :]
        return self.self_attn.attend(q, cache["k"], cache["v"], mask, cached=True, rows=rows)

    def _cross_attention(self, h: Tensor, enc: Encoded, cache: dict[str, Tensor] | None,
                         beams: Slots | None) -> Tensor:
        if cache is None:
            k, v = self.cross_attn.keys_values(enc.memory)
            return self.cross_attn.attend(self.cross_attn.query(h), k, v, mask=enc.mask)
        # Incremental: h is (N, 1, D), the rows of each sentence next to each other. The beams of a
        # sentence become that sentence's queries, so all of them attend to its one copy of the encoder
        # keys/values (B, H, S, K): nothing is copied per beam or per step. Rows of sentences with
        # fewer beams than others are first spread to (B, W) slots (zeros in the empty ones).
        k, v = cache["memory_k"], cache["memory_v"]
        rows, sentences = h.shape[0], k.shape[0]
        per_sentence = h.view(sentences, rows // sentences, -1) if beams is None else None
        queries = beams.spread(h[:, 0], 0.0) if beams is not None else per_sentence  # (B, W, D)
        y = self.cross_attn.attend(self.cross_attn.query(queries), k, v, enc.mask, cached=True)
        if beams is not None:
            y = y.flatten(0, 1)[beams.slot]
        return y.view(rows, 1, -1)


class Transformer(nn.Module):
    """Encoder-decoder with one embedding matrix shared by source, target and output (section 3.4),
    positions added as sinusoids (section 3.5) or, with `positions: learned`, from a trained table
    (section 3.5 and table 3 row E).

    The settings a fairseq model needs (`nmt import fairseq`): separate source (`src_embed`) and output
    (`output_proj`) matrices, separate learned position tables, an output over only the first
    `output_vocab` dictionary entries, fairseq's sinusoids, and EOS as the decoder's first input. A
    MarianMT model (`nmt import huggingface`) needs a feed-forward activation, a bias on the output
    logits and PAD as the decoder's first input.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.output_vocab = cfg.output_vocab or vocab_size
        self.embed = self._table(vocab_size, padding=True)  # target input (and source, output when shared)
        if cfg.share_embeddings != "all":
            self.src_embed = self._table(vocab_size, padding=True)
        if cfg.share_embeddings == "none":
            self.output_proj = self._table(self.output_vocab)
        if cfg.positions == "learned":
            self.learned_positions = self._table(cfg.max_positions)
            if not cfg.shared_positions:
                self.src_learned_positions = self._table(cfg.max_positions)
        else:
            table = (sinusoids if cfg.positions == "sinusoidal" else fairseq_sinusoids)(cfg.max_positions,
                                                                                      cfg.d_model)
            self.register_buffer("positions", table, persistent=False)
        if cfg.output_bias:
            self.output_bias = nn.Parameter(torch.zeros(self.output_vocab))
        self.int8_output: nn.Module | None = None  # the output projection in int8 (`model/int8.py`)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the last sub-layer's output unnormalised; post-norm has normalised it already.
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()

    def _table(self, rows: int, padding: bool = False) -> nn.Embedding:
        table = nn.Embedding(rows, self.cfg.d_model, padding_idx=PAD if padding else None)
        nn.init.normal_(table.weight, mean=0.0, std=self.cfg.d_model**-0.5)  # unit variance after * sqrt(D)
        if padding:
            with torch.no_grad():
                table.weight[PAD].zero_()
        return table

    def _embed(self, tokens: Tensor, start: int | Tensor = 0, source: bool = False) -> Tensor:
        """(B, L) -> (B, L, D), the positions from `start`, or row b's from start[b] (a Tensor (B,))."""
        length = tokens.shape[1]
        if not isinstance(start, Tensor) and start + length > self.cfg.max_positions:  # a Tensor: the
            # decoder's steps, whose positions the search bounds
            raise ValueError(f"sequence of {start + length} tokens exceeds "
                             f"max_positions={self.cfg.max_positions}")
        if self.cfg.positions == "learned":
            table = (self.src_learned_positions if source and not self.cfg.shared_positions
                     else self.learned_positions).weight
        else:
            table = self.positions
        if not source and self.cfg.decoder_start != "bos":  # fairseq's decoder reads EOS where nmt's
            # reads BOS, MarianMT's PAD
            tokens = tokens.masked_fill(tokens == BOS, EOS if self.cfg.decoder_start == "eos" else PAD)
        embed = self.src_embed if source and self.cfg.share_embeddings != "all" else self.embed
        positions = table[start][:, None] if isinstance(start, Tensor) else table[start : start + length]
        x = embed(tokens) * math.sqrt(self.cfg.d_model) + positions
        return self.embed_dropout(x)

    def encode(self, src: Tensor) -> Encoded:
        """src (B, S) token ids, right-padded with PAD, each ending in EOS."""
        mask = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)
        x = self._embed(src, source=True)
        for layer in self.encoder:
            x = layer(x, mask)
        return Encoded(self.encoder_norm(x), mask)

    def decode(self, prev: Tensor, enc: Encoded) -> Tensor:
        """Teacher forcing: prev (B, T) = BOS + target[:-1] -> hidden states (B, T, D)."""
        x = self._embed(prev)
        for layer in self.decoder:
            x = layer(x, enc, None)
        return self.decoder_norm(x)

    def output_weight(self) -> Tensor:
        """The output projection's matrix (V, D): tied to the embedding unless separate."""
        return self.output_proj.weight if self.cfg.share_embeddings == "none" else self.embed.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """(..., D) -> (..., V_out): the output projection, tied to the embedding unless separate; over
        the first `output_vocab` dictionary entries (all of them unless set); plus `output_bias` if set."""
        if self.int8_output is not None:
            logits = self.int8_output(hidden)
        else:
            logits = output_projection(hidden, self.output_weight(), self.output_vocab)
        return logits + self.output_bias.to(logits.dtype) if self.cfg.output_bias else logits

    def forward(self, src: Tensor, prev: Tensor, keep: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) for the N flat positions of (B * T) in `keep`
        (N,): the trainer keeps the real target positions, so padding never reaches the output
        projection. Indices, not a mask: selecting by a mask makes the device count it for the host."""
        hidden = self.decode(prev, self.encode(src))  # (B, T, D)
        return self.logits(hidden if keep is None else hidden.flatten(0, 1).index_select(0, keep))

    # -- incremental decoding, one target position per call ---------------------------------------

    def start_decoding(self, enc: Encoded) -> Cache:
        """A fresh cache holding each layer's keys/values over the encoder output, and empty pools for
        the self-attention's, with room for a few steps of the B sentences (they grow as needed)."""
        layers = []
        B, device, dtype = enc.memory.shape[0], enc.memory.device, enc.memory.dtype
        for layer, (k, v) in zip(self.decoder, self._memory_keys_values(enc), strict=True):
            attn = layer.self_attn
            widths = [width // attn.heads for width in attn.widths[1:]]
            layers.append({"memory_k": k, "memory_v": v,
                           **{name: torch.empty(16 * B, attn.heads, width, device=device, dtype=dtype)
                              for name, width in zip(("k", "v"), widths, strict=True)}})
        return Cache(layers)

    def _memory_keys_values(self, enc: Encoded) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's cross-attention keys and values over the encoder output, contiguous:
        every step's attention reads them as they are."""
        return [tuple(t.contiguous() for t in layer.cross_attn.keys_values(enc.memory))  # type: ignore[misc]
                for layer in self.decoder]

    def join(self, enc: Encoded, cache: Cache, new: Encoded) -> tuple[Encoded, Cache]:
        """The sentences of `new` join those of `enc` and `cache` (B + B' sentences, the new ones
        last, one decoder row each, at their first step: `Cache.join`). The encoder states are padded
        to the longer of the two (padding is masked), and the old ones lose padding no sentence needs
        any longer."""
        length = max(int(enc.mask.sum(-1).max()), new.memory.shape[1])
        for layer, added in zip(cache.layers, self._memory_keys_values(new), strict=True):
            for name, keys in zip(("memory_k", "memory_v"), added, strict=True):
                layer[name] = torch.cat([_to_length(layer[name], 2, length), _to_length(keys, 2, length)])
        enc = Encoded(torch.cat([_to_length(enc.memory, 1, length), _to_length(new.memory, 1, length)]),
                      torch.cat([_to_length(enc.mask, 3, length), _to_length(new.mask, 3, length)]))
        cache.join(new.memory.shape[0])
        return enc, cache

    def decode_step(self, tokens: Tensor, step: int | Tensor, enc: Encoded, cache: Cache,
                    beams: Slots | None = None) -> Tensor:
        """tokens (N,) at target position `step` (0 for BOS; a Tensor (N,): each row's, where rows
        joined at different steps) -> logits (N, V) of the next token. Rows
        are grouped by sentence: without `beams`, N = B * beam and rows b * beam ... (b + 1) * beam - 1
        belong to sentence b of `enc` (B sentences; beam may be 1); `beams` says where they are when
        sentences have different numbers of them."""
        return self.logits(self.decode_hidden(tokens, step, enc, cache, beams))

    def decode_hidden(self, tokens: Tensor, step: int | Tensor, enc: Encoded, cache: Cache,
                      beams: Slots | None = None) -> Tensor:
        """`decode_step` up to the output projection: the decoder's output (N, D)."""
        if cache.rows is None:
            cache.start(len(tokens), tokens.device)
        elif cache.written:  # a second step without `reorder`: the same rows go on
            cache.advance(torch.arange(len(tokens), device=tokens.device))
        cache.written = True
        x = self._embed(tokens[:, None], start=step)  # (N, 1, D)
        for layer, layer_cache in zip(self.decoder, cache.layers, strict=True):
            x = layer(x, enc, layer_cache, beams, cache.rows, cache.filled, cache.valid)
        return self.decoder_norm(x[:, 0])

    @staticmethod
    def reorder(enc: Encoded, cache: Cache, order: Tensor,
                sentences: Tensor | None = None) -> tuple[Encoded, Cache]:
        """Keep decoder rows `order` (N'): the beams that survive, grouped by sentence as in
        `decode_step`. Encoder states are shared by a sentence's beams, so they change only when
        sentences leave: `sentences` (B',) are the ones still decoding (None: all)."""
        cache.advance(order)
        for layer in cache.layers:
            if sentences is not None:
                layer["memory_k"] = layer["memory_k"].index_select(0, sentences)
                layer["memory_v"] = layer["memory_v"].index_select(0, sentences)
        if sentences is not None:
            enc = Encoded(enc.memory.index_select(0, sentences), enc.mask.index_select(0, sentences))
        return enc, cache


def _to_length(x: Tensor, dim: int, length: int) -> Tensor:
    """x cut or zero-padded (False for a mask) along `dim` to `length`."""
    if x.shape[dim] >= length:
        return x.narrow(dim, 0, length)
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, length - x.shape[dim]])


def build_model(cfg: ModelConfig, dictionary: Dictionary, weights: Mapping[str, Tensor] | None = None,
                where: str = "the model") -> Transformer:
    """The one place a model is made from its settings and the dictionary it reads and writes: with
    fresh weights (a training run), or with `weights` loaded (a model file, an importer, a fine-tuning
    run's --init file), which must fit the settings exactly; `where` names them when they do not."""
    if cfg.output_vocab > len(dictionary):
        raise NmtError(f"{where}: model.output_vocab ({cfg.output_vocab}) is larger than its dictionary "
                       f"({len(dictionary)} symbols)")
    model = Transformer(cfg, len(dictionary))
    if weights is not None:
        load_weights(model, weights, where)
    return model


def load_weights(model: nn.Module, weights: Mapping[str, Tensor], where: str) -> None:
    """Copy `weights` into `model`: every parameter and buffer it saves, no other, each of its shape."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a shape that differs; torch names it on the message's second line
        detail = [line.strip() for line in str(e).splitlines()]
        raise NmtError(f"{where}: the weights do not fit its model settings ({(detail[1:] or detail)[0]})"
                       ) from None
    if missing or unexpected:
        raise NmtError(f"{where}: the weights do not fit its model settings (missing {missing[:3]}, "
                       f"not expected {unexpected[:3]})")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
