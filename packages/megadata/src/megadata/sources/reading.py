"""Bounded reads of a source file: its lines, or its whole contents, never holding more than a
document's size limit (`max_doc_bytes`); a compressed file (.bz2, .gz) is read through its
decompressor."""

import bz2
import gzip
from collections.abc import Iterator
from pathlib import Path

from megadata.file_pieces import Piece, open_lines
from megadata.sources.problems import Notes, too_large

_CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"


def open_binary(path: Path):
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_lines(
    f, limit: int, first: int = 1, stop: int | None = None
) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes, size) per line of a binary file from line `first` on (while
    fewer than `stop` bytes are read, if given), a UTF-8 byte-order mark dropped; the bytes
    are None for a line of more than `limit` bytes, read past in chunks, never held."""
    number, read = first - 1, 0
    while (stop is None or read < stop) and (raw := f.readline(limit + 1)):
        number += 1
        read += len(raw)
        whole = len(raw) <= limit or raw.endswith(b"\n")
        if number == 1:
            raw = raw.removeprefix(BOM)
        if whole:
            yield number, raw, len(raw)
            continue
        size = len(raw)
        while chunk := f.readline(_CHUNK):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        read += size - len(raw)
        yield number, None, size


def read_at_most(f, limit: int) -> tuple[bytes | None, int]:
    """(the whole contents, size), or (None, size) when over `limit` bytes (read past)."""
    data = f.read(limit + 1)
    if len(data) <= limit:
        return data, len(data)
    size = len(data)
    del data
    while chunk := f.read(_CHUNK):
        size += len(chunk)
    return None, size


def lines_within(
    path: Path, piece: Piece | None, note: Notes, limit: int
) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of the file (or of the piece) of at most `limit`
    bytes; a longer one is noted and read past."""
    f, first, stop = (open_binary(path), 1, None) if piece is None else open_lines(path, piece)
    with f:
        for number, raw, size in read_lines(f, limit, first, stop):
            if raw is None:
                too_large(note, number, size, limit, "line")
            else:
                yield number, raw
