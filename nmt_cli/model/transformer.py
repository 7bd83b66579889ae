"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017, section 3), with an
incremental decoder for search.

Shape legend for every tensor comment in the package:
    B batch, S source length, T target length, D model width (d_model), H heads,
    K head width (d_k = D / H), F feed-forward width (d_ff), V vocabulary.

The model knows nothing about distribution, checkpoints or search: `train` wraps it in DDP,
`search` drives `start_decoding` / `decode_step` / `reorder`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt_cli.config.model import ModelConfig
from nmt_cli.data.dataset import BOS, EOS, PAD

# One dict per decoder layer: "memory_k"/"memory_v" over the encoder output (one copy per sentence),
# "k"/"v" of the self-attention so far (one per row), "k_next"/"v_next" prepared by `reorder`.
Cache = list[dict[str, Tensor]]


class Beams(NamedTuple):
    """Where the decoder's rows sit among the sentences' beams when the sentences keep different numbers
    of live hypotheses: each of B sentences has W slots, and only the N slots that hold one get a row."""

    row: Tensor  # (B, W): the row of slot w of sentence b; N (no row) where the slot is empty
    slot: Tensor  # (N,): the flat position b * W + w of each row

    def spread(self, rows: Tensor, fill: float) -> Tensor:
        """rows (N, ...) -> (B, W, ...): each row in its slot, `fill` in the empty ones."""
        return torch.cat([rows, rows.new_full((1, *rows.shape[1:]), fill)])[self.row]

    def sentence(self) -> Tensor:
        """(N,): the sentence of each row."""
        return self.slot // self.row.shape[1]


def sinusoids(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D))  (section 3.5)."""
    assert d_model % 2 == 0, "d_model must be even for sinusoidal positions"
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)
    return table.float()  # (L, D)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float) -> Tensor:
    """softmax(Q K^T / sqrt(K)) V (section 3.2.1): (B, H, T, K) queries over (B, H, L, K) keys and
    values -> (B, H, T, K). `mask` (broadcast to (B, H, T, L)) is True where attending is allowed;
    `causal` lets query t see keys <= t.

    GPUs take `scaled_dot_product_attention` and its fused kernels. A CPU takes two batched matrix
    products around a float32 softmax: for translation's short sentences that is several times
    faster than torch's fused CPU kernels (bf16, (80, 4, 32, 64) heads, forward + backward: 3.4 ms
    against 20 ms for the flash kernel and 12 ms for torch's own math path, which computes in float32).
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    weights = attention_weights(q, k, mask, causal).to(v.dtype)
    if dropout > 0:
        weights = F.dropout(weights, dropout)
    return weights @ v


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """`attention` of incremental decoding: a few queries (the beams of a sentence, or one row's newest
    position) over cached keys and values. Inside torch.compile on a CPU it is written as products and
    sums, which inductor fuses into one kernel that reads each cached key and value once: 2-3x faster
    than the two batched matrix products, which it leaves to torch (bf16, 240 rows over 8-80 cached
    positions: 0.5-2.7 against 1.5-6.0 us a row). Elsewhere it is `attention`."""
    if not (torch.compiler.is_compiling() and q.device.type == "cpu"):
        return attention(q, k, v, mask, causal=False, dropout=0.0)
    scores = (q.float()[:, :, :, None] * q.shape[-1] ** -0.5 * k.float()[:, :, None]).sum(-1)  # (B, H, T, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights[..., None] * v.float()[:, :, None]).sum(-2).to(v.dtype)  # (B, H, T, K)


class NextTokens(NamedTuple):
    """The most probable next tokens of each decoder row, best first."""

    log_probs: Tensor  # (N, k) float32
    tokens: Tensor  # (N, k)
    eos: Tensor  # (N,) float32: the log-probability of EOS


def best_tokens(logits: Tensor, k: int) -> NextTokens:
    """The k most probable tokens of each row of logits (N, V) other than PAD and BOS (which no output
    contains; the probabilities are not renormalised without them), and every row's EOS log-probability.

    Inside torch.compile on a CPU, for a vocabulary of size G * groups with G a multiple of 8 (see
    `_group_size`), the top k are found in two stages: the maximum of each group of G logits (one
    fused pass over the logits), then the top k among the logits of the k groups with the largest
    maxima, which hold them (a group holding one of them has a maximum at least as large). Their
    log-probabilities are the logits minus the log-sum-exp, in float32. In a compiled search (bf16,
    one thread, 300 sentences of newstest2014, 7968 tokens) this took 0.27 s where `log_softmax` and
    `topk` over whole rows took 0.49 s. Elsewhere it is `log_softmax` + `topk`. Equal logits may be
    ranked in a different order by the two.
    """
    N, V = logits.shape
    G = _group_size(V)
    if not (torch.compiler.is_compiling() and logits.device.type == "cpu" and G and k <= V // G):
        log_probs = torch.log_softmax(logits, dim=-1)  # accumulates in fp32; keeps the logits' dtype
        log_probs[:, PAD] = -math.inf
        log_probs[:, BOS] = -math.inf
        top, tokens = log_probs.topk(min(k, V), dim=-1)
        return NextTokens(top.float(), tokens, log_probs[:, EOS].float())
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # (N, 1)
    columns = torch.arange(V, device=logits.device).view(V // G, G)
    allowed = (columns != PAD) & (columns != BOS)
    groups = torch.where(allowed, logits.view(N, V // G, G), -math.inf)  # (N, V / G, G)
    chosen = groups.amax(-1).topk(k, dim=-1).indices  # (N, k) groups
    candidates = groups.gather(1, chosen[:, :, None].expand(N, k, G)).view(N, k * G)
    top, index = candidates.topk(k, dim=-1)
    tokens = chosen.gather(1, index // G) * G + index % G
    return NextTokens(top.float() - lse, tokens, logits[:, EOS].float() - lse[:, 0])


def _group_size(vocab: int) -> int:
    """For `best_tokens`: the multiple of 8 that divides `vocab` closest to its square root (0: none
    from 32 to vocab / 8)."""
    sizes = [g for g in range(32, vocab // 8 + 1, 8) if vocab % g == 0]
    return min(sizes, key=lambda g: abs(g - math.sqrt(vocab)), default=0)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """The softmax rows softmax(Q K^T / sqrt(K)) of `attention`, (B, H, T, L) in float32, masked
    positions exactly 0: on a CPU, the rows it multiplies V by; a GPU's fused kernel matches them to
    rounding (`nmt attention` calls it there to look at them)."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, T, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        T, L = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores.float(), dim=-1)


class Dropout(nn.Dropout):
    """Dropout that draws its mask faster on a CPU: four 16-bit random numbers from each 64-bit draw,
    instead of one draw per element (forward + backward 2.1 ms against 3.5 ms for an (80, 32, 256)
    tensor on a 2-core AVX512-BF16 CPU; 17 calls per step of a 6-layer model). The drop probability is rounded to a multiple of 1/65536
    (0.1 becomes 0.100006); kept values are scaled by 1 / (1 - that probability). GPUs keep torch's."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        drop_below = round(self.p * 65536)  # draws in [0, drop_below) of [0, 65536) are dropped
        n = x.numel()
        bits = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
        keep = bits.view(torch.int16)[:n].view(x.shape) >= drop_below - 32768
        return x * keep * (65536 / (65536 - drop_below))  # scaled in float32 then rounded, as torch does


class Encoded(NamedTuple):
    memory: Tensor  # (B, S, D) encoder output
    mask: Tensor  # (B, 1, 1, S) True where the source token is real, for attention over it


class Attention(nn.Module):
    """Multi-head scaled dot-product attention: softmax(Q K^T / sqrt(K)) V per head, then W^O (3.2).

    `recorder`, None except while `nmt attention` looks (see `attention.recording`), is called with
    every softmax (B, H, T, L) this layer applies; the output is computed as always.
    """

    recorder: Callable[[Tensor], None] | None = None

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        assert d_model % heads == 0, "d_model must be divisible by the number of heads"
        self.heads, self.dropout = heads, dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model)  # W^Q, W^K, W^V of all heads, stacked
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        for block in self.in_proj.weight.chunk(3):
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: Tensor) -> Tensor:  # (B, L, D) -> (B, H, L, K)
        B, L, D = x.shape
        return x.view(B, L, self.heads, D // self.heads).transpose(1, 2)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of self-attention, each (B, H, L, K)."""
        q, k, v = F.linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def query(self, x: Tensor) -> Tensor:
        d = x.shape[-1]
        return self._heads(F.linear(x, self.in_proj.weight[:d], self.in_proj.bias[:d]))

    def keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values over the encoder output, (B, H, S, K) each: computed once per sentence."""
        d = memory.shape[-1]
        k, v = F.linear(memory, self.in_proj.weight[d:], self.in_proj.bias[d:]).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
               cached: bool = False) -> Tensor:
        """(B, H, T, K) queries over (B, H, L, K) keys/values -> (B, T, D). `mask` is True where allowed;
        `cached`: incremental decoding's queries over cached keys/values (`cached_attention`)."""
        if self.recorder is not None:
            self.recorder(attention_weights(q, k, mask, causal))
        if cached:
            return self._merge(cached_attention(q, k, v, mask))
        return self._merge(attention(q, k, v, mask, causal, self.dropout if self.training else 0.0))

    def _merge(self, y: Tensor) -> Tensor:  # (B, H, T, K) -> W^O applied to the heads side by side (B, T, D)
        B, H, T, K = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * K))


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2  (section 3.3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        self.activation_dropout = Dropout(cfg.activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.activation_dropout(F.relu(self.fc1(x))))


class Residual(nn.Module):
    """One sub-layer with its residual connection: post-norm LayerNorm(x + Dropout(f(x))) as in the
    paper (section 5.4), or pre-norm x + Dropout(f(LayerNorm(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm, self.dropout, self.pre_norm = nn.LayerNorm(cfg.d_model), Dropout(cfg.dropout), cfg.norm == "pre"

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn, self.ffn = Attention(cfg.d_model, cfg.heads, cfg.attention_dropout), FeedForward(cfg)
        self.attn_block, self.ffn_block = Residual(cfg), Residual(cfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # (B, S, D), (B, 1, 1, S) -> (B, S, D)
        x = self.attn_block(x, lambda h: self.self_attn.attend(*self.self_attn.qkv(h), mask=mask))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.cross_attn = Attention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg)
        self.self_block, self.cross_block, self.ffn_block = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(self, x: Tensor, enc: Encoded, cache: dict[str, Tensor] | None, beams: Beams | None = None) -> Tensor:
        """x (B, T, D) -> (B, T, D). With a cache, x is the newest position only (T = 1)."""
        x = self.self_block(x, lambda h: self._self_attention(h, cache))
        x = self.cross_block(x, lambda h: self._cross_attention(h, enc, cache, beams))
        return self.ffn_block(x, self.ffn)

    def _self_attention(self, h: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
        q, k, v = self.self_attn.qkv(h)
        if cache is None:  # whole target at once: position t sees positions <= t (causal mask)
            return self.self_attn.attend(q, k, v, causal=True)
        # One new position: it sees everything cached so far, no mask needed.
        return self.self_attn.attend(q, _append(cache, "k", k), _append(cache, "v", v), cached=True)

    def _cross_attention(self, h: Tensor, enc: Encoded, cache: dict[str, Tensor] | None,
                         beams: Beams | None) -> Tensor:
        if cache is None:
            k, v = self.cross_attn.keys_values(enc.memory)
            return self.cross_attn.attend(self.cross_attn.query(h), k, v, mask=enc.mask)
        # Incremental: h is (N, 1, D), the rows of each sentence next to each other. The beams of a
        # sentence become that sentence's queries, so all of them attend to its one copy of the encoder
        # keys/values (B, H, S, K): nothing is copied per beam or per step. Rows of sentences with
        # fewer beams than others are first spread to (B, W) slots (zeros in the empty ones).
        k, v = cache["memory_k"], cache["memory_v"]
        rows, sentences = h.shape[0], k.shape[0]
        queries = h.view(sentences, rows // sentences, -1) if beams is None else beams.spread(h[:, 0], 0.0)  # (B, W, D)
        y = self.cross_attn.attend(self.cross_attn.query(queries), k, v, enc.mask, cached=True)
        if beams is not None:
            y = y.flatten(0, 1)[beams.slot]
        return y.view(rows, 1, -1)


def _append(cache: dict[str, Tensor], name: str, new: Tensor) -> Tensor:
    """Add the newest position's keys or values (N, H, 1, K) after the cached ones; returns all so far,
    (N, H, t + 1, K) and contiguous (batched matrix products copy strided operands first). `reorder`
    leaves a free last position in its copy, so a beam step copies the cache once, not twice."""
    slot = cache.pop(f"{name}_next", None)
    if slot is not None:
        slot[:, :, -1:] = new
        cache[name] = slot
    else:
        cache[name] = torch.cat([cache[name], new], dim=2) if name in cache else new
    return cache[name]


def _reorder_rows(cache: dict[str, Tensor], name: str, order: Tensor) -> None:
    """Keep rows `order` of the cached `name`, copied into a tensor with one free position at the end."""
    old = cache[name]
    rows, heads, length, width = old.shape
    following = old.new_empty(len(order), heads, length + 1, width)
    cache[name] = torch.index_select(old, 0, order, out=following[:, :, :length])
    cache[f"{name}_next"] = following


class Transformer(nn.Module):
    """Encoder-decoder with one embedding matrix shared by source, target and output (section 3.4)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, mean=0.0, std=cfg.d_model**-0.5)  # unit variance after * sqrt(D)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves the last sub-layer's output unnormalised; post-norm has normalised it already.
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()

    def _embed(self, tokens: Tensor, start: int = 0) -> Tensor:  # (B, L) -> (B, L, D)
        length = tokens.shape[1]
        if start + length > self.cfg.max_positions:
            raise ValueError(f"sequence of {start + length} tokens exceeds max_positions={self.cfg.max_positions}")
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model) + self.positions[start : start + length]
        return self.embed_dropout(x)

    def encode(self, src: Tensor) -> Encoded:
        """src (B, S) token ids, right-padded with PAD, each ending in EOS."""
        mask = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        return Encoded(self.encoder_norm(x), mask)

    def decode(self, prev: Tensor, enc: Encoded) -> Tensor:
        """Teacher forcing: prev (B, T) = BOS + target[:-1] -> hidden states (B, T, D)."""
        x = self._embed(prev)
        for layer in self.decoder:
            x = layer(x, enc, None)
        return self.decoder_norm(x)

    def logits(self, hidden: Tensor) -> Tensor:  # (..., D) -> (..., V), the tied output projection
        return F.linear(hidden, self.embed.weight)

    def forward(self, src: Tensor, prev: Tensor, keep: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) for the N positions where `keep` (B, T) is True:
        the trainer keeps the real target positions, so padding never reaches the output projection."""
        hidden = self.decode(prev, self.encode(src))  # (B, T, D)
        return self.logits(hidden if keep is None else hidden[keep])

    # -- incremental decoding, one target position per call ---------------------------------------

    def start_decoding(self, enc: Encoded) -> Cache:
        """A fresh cache holding each layer's keys/values over the encoder output."""
        cache = []
        for layer in self.decoder:
            k, v = layer.cross_attn.keys_values(enc.memory)  # contiguous: every step's matmul reads them as is
            cache.append({"memory_k": k.contiguous(), "memory_v": v.contiguous()})
        return cache

    def decode_step(self, tokens: Tensor, step: int, enc: Encoded, cache: Cache, beams: Beams | None = None) -> Tensor:
        """tokens (N,) at target position `step` (0 for BOS) -> logits (N, V) of the next token. Rows
        are grouped by sentence: without `beams`, N = B * beam and rows b * beam ... (b + 1) * beam - 1
        belong to sentence b of `enc` (B sentences; beam may be 1); `beams` says where they are when
        sentences have different numbers of them."""
        x = self._embed(tokens[:, None], start=step)  # (N, 1, D)
        for layer, layer_cache in zip(self.decoder, cache, strict=True):
            x = layer(x, enc, layer_cache, beams)
        return self.logits(self.decoder_norm(x[:, 0]))

    def next_tokens(self, tokens: Tensor, step: int, enc: Encoded, cache: Cache, k: int,
                    beams: Beams | None = None) -> NextTokens:
        """`decode_step`, then each row's k most probable next tokens (`best_tokens`)."""
        return best_tokens(self.decode_step(tokens, step, enc, cache, beams), k)

    @staticmethod
    def reorder(enc: Encoded, cache: Cache, order: Tensor, sentences: Tensor | None = None) -> tuple[Encoded, Cache]:
        """Keep decoder rows `order` (N'): the beams that survive, grouped by sentence as in
        `decode_step`. Encoder states are shared by a sentence's beams, so they change only when
        sentences leave: `sentences` (B',) are the ones still decoding (None: all)."""
        for layer in cache:
            for name in ("k", "v"):
                if name in layer:
                    _reorder_rows(layer, name, order)
            if sentences is not None:
                layer["memory_k"] = layer["memory_k"].index_select(0, sentences)
                layer["memory_v"] = layer["memory_v"].index_select(0, sentences)
        if sentences is not None:
            enc = Encoded(enc.memory.index_select(0, sentences), enc.mask.index_select(0, sentences))
        return enc, cache


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
