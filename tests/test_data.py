"""The dictionary file and the .bin/.idx format: round trips, O(1) reads, and damaged files refused."""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from nmt_cli.data.dataset import (
    SPECIALS,
    Dictionary,
    IndexedDataset,
    IndexedWriter,
    read_sequential,
    token_dtype,
)
from nmt_cli.errors import NmtError


def _write(prefix: Path, sentences: list[list[int]], dtype: np.dtype) -> None:
    writer = IndexedWriter(prefix, dtype)
    for start in range(0, len(sentences), 3):  # several add_many calls, as binarize makes them
        chunk = sentences[start:start + 3]
        writer.add_many(np.array([i for s in chunk for i in s], np.int64), np.array([len(s) for s in chunk]))
    writer.close()


@pytest.mark.parametrize("vocab_size", [65536, 65537])
def test_written_sentences_read_back(tmp_path: Path, vocab_size: int) -> None:
    rng = np.random.default_rng(0)
    sentences = [rng.integers(0, vocab_size, rng.integers(0, 12)).tolist() for _ in range(50)]
    sentences += [[], [vocab_size - 1]]
    dtype = token_dtype(vocab_size)
    _write(tmp_path / "train.en", sentences, dtype)
    data = IndexedDataset(tmp_path / "train.en")
    assert data.dtype == (np.uint16 if vocab_size <= 65536 else np.int32)
    assert [s.tolist() for s in data] == sentences
    assert data.sizes.tolist() == [len(s) for s in sentences]
    assert (tmp_path / "train.en.bin").stat().st_size == sum(map(len, sentences)) * dtype.itemsize


def test_reading_is_a_view_into_the_memory_map(tmp_path: Path) -> None:
    sentences = [[5, 6, 7], [8], [9, 10]]
    _write(tmp_path / "x", sentences, np.dtype(np.uint16))
    data = IndexedDataset(tmp_path / "x")
    assert isinstance(data.tokens, np.memmap) and isinstance(data.offsets, np.memmap)
    assert np.shares_memory(data[2], data.tokens)  # a slice of the map: no copy, no scan
    with open(tmp_path / "x.bin", "r+b") as f:  # change sentence 2 on disk after opening
        f.seek(4 * 2)
        f.write(np.array([42, 43], np.uint16).tobytes())
    assert data[2].tolist() == [42, 43]  # read from the file on access, not loaded at open


@pytest.mark.parametrize("sentences_per_chunk", [1, 4, 1000])
def test_sequential_reading_gives_the_same_sentences(tmp_path: Path, sentences_per_chunk: int) -> None:
    sentences = [[5, 6, 7], [], [8], [9, 10], [], [11], [12, 13, 14]]
    _write(tmp_path / "x", sentences, np.dtype(np.int32))
    chunks = list(read_sequential(tmp_path / "x", sentences_per_chunk))
    assert len(chunks) == -(-len(sentences) // sentences_per_chunk)
    ids = np.concatenate([c[0] for c in chunks]).tolist()
    sizes = np.concatenate([c[1] for c in chunks]).tolist()
    assert sizes == [len(s) for s in sentences] and ids == [i for s in sentences for i in s]


def test_empty_dataset(tmp_path: Path) -> None:
    IndexedWriter(tmp_path / "empty", np.dtype(np.uint16)).close()
    data = IndexedDataset(tmp_path / "empty")
    assert len(data) == 0 and list(data) == []


@pytest.fixture
def written(tmp_path: Path) -> Path:
    _write(tmp_path / "x", [[1, 2, 3], [4, 5], [6]], np.dtype(np.uint16))
    return tmp_path / "x"


def test_truncated_bin_is_refused(written: Path) -> None:
    bin_path = Path(f"{written}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(NmtError, match=r"points to 6 tokens but .*x\.bin holds 5.*run `nmt binarize` again"):
        IndexedDataset(written)


def test_bin_with_half_a_token_is_refused(written: Path) -> None:
    bin_path = Path(f"{written}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-1])
    with pytest.raises(NmtError, match="truncated or corrupt"):
        IndexedDataset(written)


def test_idx_pointing_past_its_bin_is_refused(written: Path) -> None:
    idx_path = Path(f"{written}.idx")
    raw = bytearray(idx_path.read_bytes())
    raw[-8:] = struct.pack("<q", 1000)  # the last offset: past the 6 tokens of the .bin
    idx_path.write_bytes(bytes(raw))
    with pytest.raises(NmtError, match=r"x\.idx points to 1000 tokens but .*x\.bin holds 6"):
        IndexedDataset(written)
    with pytest.raises(NmtError, match=r"x\.idx points to 1000 tokens"):
        next(read_sequential(written))


def test_idx_with_offsets_out_of_order_is_refused(written: Path) -> None:
    idx_path = Path(f"{written}.idx")
    raw = bytearray(idx_path.read_bytes())
    raw[24 + 8:24 + 24] = struct.pack("<qq", 5, 2)  # offsets 0, 3, 5, 6 become 0, 5, 2, 6
    idx_path.write_bytes(bytes(raw))
    with pytest.raises(NmtError, match="offsets out of order"):
        IndexedDataset(written)
    with pytest.raises(NmtError, match="offsets out of order"):
        list(read_sequential(written, 2))


@pytest.mark.parametrize("damage, message", [
    (lambda raw: b"NOTANIDX" + raw[8:], "not an nmt index file"),
    (lambda raw: raw[:8] + b"\x07" + raw[9:], "truncated or corrupt"),  # unknown dtype code
    (lambda raw: raw[:16] + struct.pack("<Q", 7) + raw[24:], "truncated or corrupt"),  # wrong sentence count
    (lambda raw: raw[:10], "not an nmt index file"),  # header cut short
])
def test_corrupt_idx_header_is_refused(written: Path, damage: Callable[[bytes], bytes], message: str) -> None:
    idx_path = Path(f"{written}.idx")
    idx_path.write_bytes(damage(idx_path.read_bytes()))
    with pytest.raises(NmtError, match=message):
        IndexedDataset(written)


def test_missing_file_is_refused(written: Path) -> None:
    Path(f"{written}.bin").unlink()
    with pytest.raises(NmtError, match=r"x\.bin is missing"):
        IndexedDataset(written)


# ---------------------------------------------------------------------------------------------
# Dictionary


def test_dictionary_order_padding_and_file_round_trip(tmp_path: Path) -> None:
    counts = Counter({"▁b": 5, "▁a": 5, "c": 9, "rare": 1, "<unk>": 4})
    dictionary = Dictionary.from_counts(counts, min_count=2)
    assert dictionary.symbols[:7] == [*SPECIALS, "c", "▁a", "▁b"]  # by count, ties by symbol
    assert "rare" not in dictionary.index and len(dictionary) == 8  # padded to a multiple of 8
    dictionary.save(tmp_path / "dict.txt")
    loaded = Dictionary.load(tmp_path / "dict.txt")
    assert (loaded.symbols, loaded.counts) == (dictionary.symbols, dictionary.counts)
    assert loaded.encode(["c", "rare", "▁b"]) == [4, 3, 6]


def test_dictionary_with_duplicate_symbols_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "dict.txt"
    path.write_text("<pad> 0\n<s> 0\n</s> 0\n<unk> 0\nx 3\ny 2\nx 1\n", encoding="utf-8")
    with pytest.raises(NmtError, match=r"dict\.txt, line 7: symbol 'x' already appears on line 5"):
        Dictionary.load(path)


@pytest.mark.parametrize("text, message", [
    ("<pad> 0\n<s> 0\n</s> 0\n<unk> 0\nx three\n", r"line 5: expected 'SYMBOL COUNT'"),
    ("x 1\n<pad> 0\n<s> 0\n</s> 0\n<unk> 0\n", "must start with the special symbols"),
])
def test_malformed_dictionary_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "dict.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(NmtError, match=message):
        Dictionary.load(path)
