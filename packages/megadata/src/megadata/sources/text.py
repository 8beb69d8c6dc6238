"""The `text` source: plain text files, one document per file, per line or per paragraph
(`split` = "file", "line" or "paragraph")."""

from collections.abc import Iterator
from pathlib import Path

from megadata.file_pieces import Piece
from megadata.sources.options import DEFAULT_MAX_DOC_BYTES
from megadata.sources.problems import Notes, decode, too_large, without_nul
from megadata.sources.reading import (
    BOM,
    lines_within,
    open_binary,
    read_at_most,
    read_lines,
)


def read_text(
    path: Path,
    split: str,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    if split not in ("file", "line", "paragraph"):
        raise ValueError(f"source {path}: split must be file, line or paragraph, got {split!r}")
    return _read_text(path, split, Notes(path, problems, listed), max_doc_bytes, piece)


def _read_text(
    path: Path, split: str, note: Notes, limit: int, piece: Piece | None
) -> Iterator[dict]:
    if split == "line":
        for number, raw in lines_within(path, piece, note, limit):
            text = decode(raw, note, number, "line")
            # Keyed by line (0-based), so that a piece names its documents as the whole
            # file would: a line cut at a form feed or U+2028 gives line.1, line.2, ...
            pieces = [p.strip() for p in without_nul(text or "", note, number).splitlines()]
            for k, text in enumerate(p for p in pieces if p):
                yield {"text": text, "_key": f"{number - 1}.{k}" if k else str(number - 1)}
        return
    with open_binary(path) as f:
        if split == "file":
            data, size = read_at_most(f, limit)
            if data is None:
                too_large(note, None, size, limit, "file")
                return
            text = decode(data.removeprefix(BOM), note, None, "file")
            if text is not None and (text := without_nul(text, note, None).strip()):
                yield {"text": text}
            return
        # paragraph: the lines up to an empty one ("\n\n" separates, as it always did); a
        # paragraph with a line that is not UTF-8, or over the size limit, is skipped whole
        lines: list[str] = []
        start, size, skipped = None, 0, False
        for number, raw, length in read_lines(f, limit):
            if raw in (b"\n", b"\r\n"):
                if lines and not skipped and (text := "\n".join(lines).strip()):
                    yield {"text": text}
                lines, start, size, skipped = [], None, 0, False
                continue
            start, size = start or number, size + length
            if skipped:
                continue
            if raw is None or size > limit:
                too_large(note, start, size, limit, "paragraph")
                lines, skipped = [], True
                continue
            text = decode(raw, note, number, "paragraph")
            if text is None:
                lines, skipped = [], True
                continue
            text = without_nul(text, note, number)
            lines.append(text[:-1].removesuffix("\r") if text.endswith("\n") else text)
        if lines and not skipped and (text := "\n".join(lines).strip()):
            yield {"text": text}
