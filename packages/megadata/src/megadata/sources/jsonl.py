"""The `jsonl` source: one JSON object per line with `text` and optionally `url`, `title` and
`source`; a line that is not JSON, is nested too deeply or has no text is skipped, lone
UTF-16 surrogates and NUL characters are removed."""

import json
import re
from collections.abc import Iterator
from pathlib import Path

from megadata.file_pieces import Piece
from megadata.sources.options import DEFAULT_MAX_DOC_BYTES
from megadata.sources.problems import Notes, decode
from megadata.sources.reading import lines_within

_SURROGATES = re.compile("[\ud800-\udfff]")
_FIELDS = ("text", "url", "title", "source")


def read_jsonl(
    path: Path,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    note = Notes(path, problems, listed)
    for number, raw in lines_within(path, piece, note, max_doc_bytes):
        if b"\x00" in raw:  # NUL bytes are NUL characters in UTF-8, wherever they are
            note("nul_chars", number, f"{raw.count(0)} NUL bytes", "removed")
            raw = raw.replace(b"\x00", b"")
        line = decode(raw, note, number, "line")
        if line is None or not (line := line.strip()):
            continue
        try:
            obj = json.loads(line, strict=False)  # control characters inside strings are kept
        except RecursionError:
            note("too_deep", number, "JSON nested too deeply", "line skipped")
            continue
        except ValueError as e:  # JSONDecodeError, or an integer of over 4300 digits
            note("bad_json", number, f"not JSON ({getattr(e, 'msg', e)})", "line skipped")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            note("no_text", number, "no 'text' string field", "line skipped")
            continue
        doc = {k: str(obj.get(k) or "") for k in _FIELDS}
        if any(_SURROGATES.search(v) for v in doc.values()):
            # Half of a UTF-16 pair (\ud800): no character, and not encodable as UTF-8.
            found = sum(len(_SURROGATES.findall(v)) for v in doc.values())
            note("lone_surrogates", number, f"{found} lone surrogate escapes", "removed")
            doc = {k: _SURROGATES.sub("", v) for k, v in doc.items()}
        if any("\x00" in v for v in doc.values()):  # from \u0000 escapes
            found = sum(v.count("\x00") for v in doc.values())
            note("nul_chars", number, f"{found} NUL characters", "removed")
            doc = {k: v.replace("\x00", "") for k, v in doc.items()}
        doc["_key"] = str(number - 1)  # by line (0-based): the same in a piece of the file
        yield doc
