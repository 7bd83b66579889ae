"""The binarized corpus: the joint dictionary, memory-mapped token arrays, and token-budget batches.

Files of one split and language (written by `nmt binarize`, read by `nmt train`):
- ``{split}.{lang}.bin``: the token ids of every sentence back to back (uint16 when the dictionary
  has at most 65536 symbols, else int32), without EOS; the model appends it.
- ``{split}.{lang}.idx``: a 24-byte header (magic, dtype code, sentence count) followed by
  count + 1 int64 offsets into the .bin (in tokens), so sentence i is ``bin[off[i]:off[i+1]]``.
Both are memory-mapped: reading a sentence is O(1) and memory does not grow with the corpus.

No torch here: `binarize` and the tests of this module do not need it.
"""

from __future__ import annotations

import contextlib
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from nmt_cli.artifacts import atomic_writer, read_lines
from nmt_cli.errors import NmtError, shown

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


class Dictionary:
    """Symbols with fixed ids: pad 0, bos 1, eos 2, unk 3, then the pieces by descending count."""

    def __init__(self, symbols: list[str], counts: list[int]) -> None:
        assert tuple(symbols[: len(SPECIALS)]) == SPECIALS and len(symbols) == len(counts)
        self.symbols, self.counts = symbols, counts
        self.index = {s: i for i, s in enumerate(symbols)}

    def __len__(self) -> int:
        return len(self.symbols)

    @classmethod
    def from_counts(cls, counts: Counter[str], min_count: int = 0, pad_to_multiple: int = 8) -> Dictionary:
        """Most frequent first (ties by symbol, so the order is reproducible); padded with unused
        `<madeupwordN>` symbols to a multiple of 8 so matrix products tile well on GPUs."""
        kept = sorted((s for s, c in counts.items() if c >= min_count and s not in SPECIALS),
                      key=lambda s: (-counts[s], s))
        symbols = [*SPECIALS, *kept]
        freq = [0] * len(SPECIALS) + [counts[s] for s in kept]
        while len(symbols) % pad_to_multiple:
            symbols.append(f"<madeupword{len(symbols)}>")
            freq.append(0)
        return cls(symbols, freq)

    @classmethod
    def load(cls, path: Path) -> Dictionary:
        """Read `dict.txt` (one ``symbol count`` per line, id = line number - 1)."""
        symbols, counts = [], []
        for number, line in enumerate(read_lines(path), start=1):
            symbol, sep, count = line.rpartition(" ")
            if not sep or not symbol or not count.isdigit():
                raise NmtError(f"{path}, line {number}: expected 'SYMBOL COUNT', got {shown(line)}; "
                               "rebuild the dictionary with `nmt binarize`")
            symbols.append(symbol)
            counts.append(int(count))
        return cls.checked(symbols, counts, str(path), "rebuild it with `nmt binarize`")

    @classmethod
    def checked(cls, symbols: list[str], counts: list[int], source: str, fix: str,
                unit: str = "line") -> Dictionary:
        """A dictionary of symbols read from a file, refused (naming `source`, the `unit` number and
        `fix`) unless the special symbols come first and every symbol is unique."""
        if tuple(symbols[: len(SPECIALS)]) != SPECIALS:
            raise NmtError(f"{source} must start with the special symbols {' '.join(SPECIALS)}; {fix}")
        seen: dict[str, int] = {}
        for number, symbol in enumerate(symbols, start=1):
            if symbol in seen:
                raise NmtError(f"{source}, {unit} {number}: symbol {shown(symbol)} already appears on {unit} "
                               f"{seen[symbol]}; every symbol must be unique ({fix})")
            seen[symbol] = number
        return cls(symbols, counts)

    def save(self, path: Path) -> None:
        with atomic_writer(path, "w") as f:
            f.writelines(f"{s} {c}\n" for s, c in zip(self.symbols, self.counts, strict=True))

    def encode(self, pieces: Iterable[str]) -> list[int]:
        get = self.index.get
        return [get(p, UNK) for p in pieces]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Pieces of `ids`, stopping at EOS and leaving out pad/bos."""
        pieces = []
        for i in ids:
            if i == EOS:
                break
            if i not in (PAD, BOS):
                pieces.append(self.symbols[i])
        return pieces


# ---------------------------------------------------------------------------------------------
# .bin/.idx token arrays

_MAGIC = b"NMTIDX01"
_HEADER = struct.Struct("<8sB7xQ")  # magic, dtype code, (padding), number of sentences
_DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}


def token_dtype(vocab_size: int) -> np.dtype:
    return _DTYPES[1] if vocab_size <= 1 << 16 else _DTYPES[2]


class IndexedWriter:
    """Appends sentences to ``PREFIX.bin``/``PREFIX.idx`` through temporary files; `close()`
    renames both into place, so a crash never leaves a pair that looks complete."""

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._bin_ctx = atomic_writer(self.prefix.with_suffix(self.prefix.suffix + ".bin"))
        self._idx_ctx = atomic_writer(self.prefix.with_suffix(self.prefix.suffix + ".idx"))
        self._bin, self._idx = self._bin_ctx.__enter__(), self._idx_ctx.__enter__()
        self._idx.write(_HEADER.pack(_MAGIC, 0, 0))  # rewritten with the real count on close
        self._idx.write(np.zeros(1, np.int64).tobytes())
        self.count, self.tokens = 0, 0

    def add_many(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append len(lengths) sentences whose ids are concatenated in `ids`."""
        assert int(np.sum(lengths)) == ids.size, "lengths must add up to the number of ids"
        assert ids.size == 0 or 0 <= int(ids.min()) <= int(ids.max()) <= np.iinfo(self.dtype).max, \
            "an id does not fit the file's dtype: pick it with token_dtype(len(dictionary))"
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._idx.write((self.tokens + np.cumsum(lengths, dtype=np.int64)).tobytes())
        self.count += len(lengths)
        self.tokens += int(ids.size)

    def close(self) -> None:
        code = next(c for c, d in _DTYPES.items() if d == self.dtype)
        self._idx.seek(0)
        self._idx.write(_HEADER.pack(_MAGIC, code, self.count))
        self._bin_ctx.__exit__(None, None, None)
        self._idx_ctx.__exit__(None, None, None)

    def abort(self) -> None:
        err = RuntimeError("aborted")
        for ctx in (self._bin_ctx, self._idx_ctx):
            with contextlib.suppress(RuntimeError):
                ctx.__exit__(RuntimeError, err, None)


def _check_pair(prefix: Path) -> tuple[Path, Path, np.dtype, int]:
    """(idx path, bin path, dtype, sentence count) of a .bin/.idx pair whose header and sizes agree."""
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx_path, bin_path):
        if not path.exists():
            raise NmtError(f"{path} is missing; run `nmt binarize` again")
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:8] != _MAGIC:
            raise NmtError(f"{idx_path} is not an nmt index file (bad header); run `nmt binarize` again")
        _, code, count = _HEADER.unpack(header)
        if code not in _DTYPES or idx_path.stat().st_size != _HEADER.size + 8 * (count + 1):
            raise NmtError(f"{idx_path} is truncated or corrupt; run `nmt binarize` again")
        f.seek(-8, 2)
        last_offset = int(np.frombuffer(f.read(8), np.int64)[0])
    dtype = _DTYPES[code]
    n_tokens = bin_path.stat().st_size // dtype.itemsize
    if bin_path.stat().st_size % dtype.itemsize or last_offset != n_tokens:
        raise NmtError(f"{idx_path} points to {last_offset} tokens but {bin_path} holds "
                       f"{n_tokens}: one of them is truncated or corrupt; run `nmt binarize` again")
    return idx_path, bin_path, dtype, count


def _check_sizes(sizes: np.ndarray, idx_path: Path) -> None:
    if (sizes < 0).any():
        raise NmtError(f"{idx_path} has offsets out of order; run `nmt binarize` again")


class IndexedDataset:
    """Read-only, memory-mapped access to one ``PREFIX.bin``/``PREFIX.idx`` pair."""

    def __init__(self, prefix: Path) -> None:
        idx_path, bin_path, self.dtype, count = _check_pair(Path(prefix))
        self.offsets = np.memmap(idx_path, np.int64, "r", offset=_HEADER.size, shape=(count + 1,))
        self.sizes = np.diff(self.offsets).astype(np.int32)
        if self.offsets[0] != 0:
            raise NmtError(f"{idx_path} has offsets out of order; run `nmt binarize` again")
        _check_sizes(self.sizes, idx_path)
        n_tokens = int(self.offsets[-1])
        self.tokens = np.memmap(bin_path, self.dtype, "r") if n_tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


def read_sequential(prefix: Path,
                    sentences_per_chunk: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, sizes) of consecutive chunks of sentences of a .bin/.idx pair, read with plain reads.

    For one pass over a whole pair (binarize maps provisional ids this way): the pages of a memory
    map stay resident once read, so reading everything through `IndexedDataset` would grow memory
    with the file, while this stays flat.
    """
    idx_path, bin_path, dtype, count = _check_pair(Path(prefix))
    with open(idx_path, "rb") as idx, open(bin_path, "rb") as tokens:
        idx.seek(_HEADER.size)
        previous = np.fromfile(idx, np.int64, 1)
        if previous[0] != 0:
            raise NmtError(f"{idx_path} has offsets out of order; run `nmt binarize` again")
        for start in range(0, count, sentences_per_chunk):
            chunk = np.fromfile(idx, np.int64, min(sentences_per_chunk, count - start))
            offsets = np.concatenate([previous, chunk])
            sizes = np.diff(offsets)
            _check_sizes(sizes, idx_path)
            yield np.fromfile(tokens, dtype, int(offsets[-1] - offsets[0])), sizes
            previous = offsets[-1:]


# ---------------------------------------------------------------------------------------------
# Batches under a token budget


def batch_by_size(indices: np.ndarray, src_sizes: np.ndarray, tgt_sizes: np.ndarray,
                  max_tokens: int) -> list[np.ndarray]:
    """Group `indices` into batches of similar length whose padded size fits `max_tokens`.

    Examples are sorted by the longer of their two sides, then by both together, and packed
    greedily; a batch's cost is ``len(batch) * max(longest source, longest target)``, padding
    included, as a device sees it. Sorted by that cost's own measure, the examples of a batch are
    all about as wide as its widest, so the budget holds more of them and less padding. (Sorted by
    (target, source) length, as fairseq does, a batch's targets were alike and its sources not, and
    an update trained fewer tokens a second; benchmarks/README.md, "Training speed: eager and
    compiled".)
    Sizes are what the model sees (EOS included). The caller leaves out examples that do not fit
    the budget or the model on their own.
    """
    src, tgt = src_sizes[indices], tgt_sizes[indices]
    wide = np.maximum(src, tgt)
    sort = np.lexsort((src + tgt, wide))
    order, width = indices[sort], wide[sort]
    batches, start, longest = [], 0, 0
    for i, w in enumerate(width.tolist()):
        longest = max(longest, w)
        if (i + 1 - start) * longest > max_tokens and i > start:
            batches.append(order[start:i])
            start, longest = i, w
    if start < len(order):
        batches.append(order[start:])
    return batches


def epoch_order(n_batches: int, epoch: int, seed: int) -> np.ndarray:
    """The order in which an epoch visits the batches: a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_batches)


def filter_by_size(src_sizes: np.ndarray, tgt_sizes: np.ndarray, max_positions: int,
                   max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, skipped) example indices: an example is skipped when either side is longer than the
    model accepts or than a whole micro-batch holds. Sizes are what the model sees (EOS included)."""
    longest = np.maximum(src_sizes, tgt_sizes)
    fits = longest <= min(max_positions, max_tokens)
    return np.flatnonzero(fits), np.flatnonzero(~fits)


def collate(src: IndexedDataset, tgt: IndexedDataset, ids: np.ndarray,
            multiple: int = 1) -> dict[str, np.ndarray]:
    """Arrays of one batch, right-padded with PAD: ``src`` (B, S) = sentence + EOS; ``prev`` (B, T) =
    BOS + target, what the decoder reads; ``target`` (B, T) = target + EOS, what it must predict;
    ``keep`` (N,) the flat positions in (B * T) of its N real target tokens (found here, so that the
    device never has to count them). S and T are rounded up to a `multiple` (a compiled model then
    meets fewer shapes)."""
    src_rows = [src[i] for i in ids]
    tgt_rows = [tgt[i] for i in ids]
    S = -(-(max(len(r) for r in src_rows) + 1) // multiple) * multiple
    T = -(-(max(len(r) for r in tgt_rows) + 1) // multiple) * multiple
    out = {name: np.full((len(ids), width), PAD, np.int64)
           for name, width in (("src", S), ("prev", T), ("target", T))}
    for b, (s, t) in enumerate(zip(src_rows, tgt_rows, strict=True)):
        out["src"][b, : len(s)], out["src"][b, len(s)] = s, EOS
        out["prev"][b, 0], out["prev"][b, 1 : len(t) + 1] = BOS, t
        out["target"][b, : len(t)], out["target"][b, len(t)] = t, EOS
    out["keep"] = np.flatnonzero(out["target"].reshape(-1) != PAD)
    out["ids"] = np.asarray(ids, np.int64)
    return out
