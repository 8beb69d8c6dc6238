"""Large input files cut into pieces that ingest tasks read in parallel.

Ingest runs a task per input file, so one file of 100 GB (the paper recipe's realnews.jsonl,
a crawl's pages.jsonl, a Wikipedia dump in one file) would be read by one core while the
cluster waits.  A file over its source's `split_mb` (256 by default; 0: never) is read as
pieces of about that many bytes instead, one task each, when its format lets a reader
start in the middle:

- `lines`: jsonl, and text with `split = "line"`, uncompressed.  Piece k holds the lines
  that start in bytes [k * S, (k + 1) * S).  Line numbers are the file's: a stage of small
  tasks first counts the newlines of every piece but the last, in parallel, and a piece
  starts counting from the newlines before it.
- `xml`: an uncompressed MediaWiki dump.  Piece k holds the pages whose `<page` starts in
  [k * S, (k + 1) * S).
- `bz2-streams`: a multistream .bz2 dump (Wikimedia's `-multistream` files: the streams of
  100 pages each, one after the other).  Piece k holds the pages that start in the streams
  that start in [k * S, (k + 1) * S); a stream starts at a `BZh` header followed by the
  block magic, found by a byte search.  A .bz2 file of one stream (the plain dump) has no
  place to start in the middle and is read whole, by one task, as before.

A page or line that crosses a piece's end is read to its end by that piece, and skipped by
the next, so every document is read once whatever the pieces.  The lines of an XML piece
are counted from where the piece starts reading (a problem there is named with that byte
offset and the line after it): counting them from the file's start would mean reading, and
for .bz2 decompressing, everything before.  Compressed jsonl and text (.gz, .bz2) is read
whole.
"""

import bz2
import re
from dataclasses import dataclass
from pathlib import Path

from megadata.settings import load
from megadata.sources.options import SourceOptions

CHUNK = 1 << 20
_STREAM_START = re.compile(rb"BZh[1-9]1AY&SY")  # a stream's header, then its first block's magic
MULTISTREAM_PROBE = 16 << 20  # a multistream dump's second stream starts well within this


@dataclass(frozen=True)
class Piece:
    index: int
    start: int  # bytes [start, end) of the file: the piece holds what starts in them
    end: int
    how: str  # "lines", "xml" or "bz2-streams"
    newlines_before: int | None = None  # in bytes [0, start) of the file ("lines" only)


def split_bytes(options: SourceOptions) -> int:
    """The source's `split_mb` in bytes (0: never split)."""
    value = load(SourceOptions, options, "source").split_mb
    return max(1, round(value * 2**20)) if value else 0


def how_to_split(kind: str, options: SourceOptions, path: Path) -> tuple[str | None, int]:
    """(how the file is cut, into how many pieces); (None, 1) for a file read whole."""
    options = load(SourceOptions, options, "source")
    limit, size = split_bytes(options), path.stat().st_size
    if not limit or size <= limit:
        return None, 1
    pieces = -(-size // limit)
    compressed = path.suffix in (".bz2", ".gz")
    if kind == "jsonl" or (kind == "text" and options.split == "line"):
        return (None, 1) if compressed else ("lines", pieces)
    if kind == "wikipedia":
        if path.suffix == ".bz2":
            return ("bz2-streams", pieces) if is_multistream(path) else (None, 1)
        return (None, 1) if compressed else ("xml", pieces)
    return None, 1


def pieces(path: Path, how: str, count: int, limit: int, newlines: list[int] | None = None):
    """The pieces of a file cut `how` into `count` pieces of `limit` bytes; `newlines[k]`:
    the newlines in piece k's bytes (`count_newlines`), for all pieces but the last."""
    size = path.stat().st_size
    before, out = 0, []
    for k in range(count):
        end = min((k + 1) * limit, size)
        out.append(Piece(k, k * limit, end, how, None if newlines is None else before))
        if newlines is not None and k < len(newlines):
            before += newlines[k]
    return out


def count_newlines(path: str, start: int, end: int) -> dict:
    """A task: the newlines in bytes [start, end) of the file."""
    found, left = 0, end - start
    with open(path, "rb") as f:
        f.seek(start)
        while left > 0 and (chunk := f.read(min(CHUNK * 16, left))):
            found += chunk.count(b"\n")
            left -= len(chunk)
    return {"bytes_in": end - start, "extra": {}, "newlines": found}


def is_multistream(path: Path) -> bool:
    """Whether a .bz2 file has a second stream within its first MULTISTREAM_PROBE bytes."""
    with open(path, "rb") as f:
        head = f.read(MULTISTREAM_PROBE)
    return _STREAM_START.search(head, 1) is not None


# ---------------------------------------------------------------- lines


def open_lines(path: Path, piece: Piece):
    """(binary file at the piece's first line, that line's number, how many bytes on from
    there a line may still start in the piece)."""
    f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    if piece.start == 0:
        return f, 1, piece.end
    try:
        f.seek(piece.start - 1)
        first = f.readline(CHUNK)
        last, read = first, len(first)
        while last and not last.endswith(b"\n"):  # the rest of the line of byte start - 1
            last = f.readline(CHUNK)
            read += len(last)
    except BaseException:
        f.close()
        raise
    # Lines before the first one here: the newlines in [0, start), less the one at start - 1
    # (when there is one), plus the one that ends the line read past.
    line = 1 + piece.newlines_before - (first == b"\n") + 1
    return f, line, piece.end - (piece.start - 1 + read)


# ---------------------------------------------------------------- XML dumps


class WholeFile:
    """A dump read whole: `read()` as the file's `read1`; every page is the task's."""

    owned_until = None

    def __init__(self, f):
        self.read = getattr(f, "read1", f.read)  # what is there now: a dump cut short loses least


class XmlRange:
    """An uncompressed dump from byte `start`: the pages that start before `end` are the
    piece's (`owned_until`: an offset in what `read()` gives)."""

    def __init__(self, f, start: int, end: int):
        f.seek(start)
        self._f, self.owned_until = f, end - start

    def read(self) -> bytes:
        return self._f.read(CHUNK)


class Bz2Streams:
    """The decompressed bytes of a multistream .bz2 file from the first stream that starts in
    [start, end) on, stream after stream; `owned_until` becomes the offset in what `read()`
    gave where the first stream that starts at `end` or later begins (the next piece's)."""

    def __init__(self, f, start: int, end: int):
        self._f, self._end = f, end
        first = find_stream(f, start, end)
        self._done = first is None  # no stream starts in the piece: it holds nothing
        self.owned_until = 0 if first is None else None
        self._at = 0 if first is None else first  # the file offset of self._raw[0]
        f.seek(self._at)
        self._raw = b""
        self._stream, self._fed = bz2.BZ2Decompressor(), False
        self._given = 0

    def read(self) -> bytes:
        while not self._done:
            if not self._raw:
                self._raw = self._f.read(CHUNK)
                if not self._raw:
                    self._done = True
                    if self._fed and not self._stream.eof:
                        raise EOFError("compressed file ended before the end-of-stream marker")
                    return b""
            try:
                data = self._stream.decompress(self._raw)
            except OSError:
                if self._fed:
                    raise
                self._done = True  # bytes after the last stream: ignored, as bz2.open does
                return b""
            self._fed = True
            if self._stream.eof:  # the next stream starts where this one's bytes end
                rest = self._stream.unused_data
                self._at += len(self._raw) - len(rest)
                self._raw, self._stream, self._fed = rest, bz2.BZ2Decompressor(), False
                if self._at >= self._end and self.owned_until is None:
                    self.owned_until = self._given + len(data)
            else:
                self._at += len(self._raw)
                self._raw = b""
            self._given += len(data)
            if data:
                return data
        return b""


def find_stream(f, start: int, end: int) -> int | None:
    """The file offset of the first stream start in [start, end), or None."""
    if start == 0:
        return 0
    overlap = len(b"BZh91AY&SY") - 1
    at = start
    while at < end:
        f.seek(at)
        window = f.read(min(CHUNK, end - at) + overlap)
        found = _STREAM_START.search(window)
        if found is not None and at + found.start() < end:
            return at + found.start()
        if len(window) <= overlap:
            return None
        at += len(window) - overlap
    return None
