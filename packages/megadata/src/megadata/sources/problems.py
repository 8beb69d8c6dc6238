"""How a source reader reports bad input: each problem counted by kind (the stage's statistics),
named with its file and line in a warning (the first `WARNINGS_PER_FILE` of a file) and listed
in full for `<stage dir>/_problems/<task>.jsonl`; and the checks every reader makes (strict
UTF-8, NUL characters, the size limit) that note what they skip or repair."""

import logging
from pathlib import Path

WARNINGS_PER_FILE = 20  # problems of a file named in the log; all are in _problems/
PROBLEMS_DIR = "_problems"
log = logging.getLogger("megadata.ingest")


class Notes:
    """Counts a file's problems by kind (into `problems`: the stage's statistics), names
    each in a warning (the first WARNINGS_PER_FILE) and lists it in `listed` (if given).
    With `from_byte`, line numbers count from that byte of the file (a piece of a dump:
    megadata.file_pieces)."""

    def __init__(
        self, path: Path, problems: dict, listed: list | None, from_byte: int | None = None
    ):
        self.path, self.problems, self.listed, self.warned = path, problems, listed, 0
        self.from_byte = from_byte

    def __call__(self, kind: str, line: int | None, message: str, action: str) -> None:
        self.problems[kind] = self.problems.get(kind, 0) + 1
        where = f"{self.path}:{line}" if line else str(self.path)
        if self.from_byte is not None:
            where = f"{self.path}, line {line} after byte {self.from_byte}"
        if self.listed is not None:
            record = {"file": str(self.path), "line": line, "problem": kind}
            if self.from_byte is not None:
                record["from_byte"] = self.from_byte
            self.listed.append({**record, "detail": message, "action": action})
        if self.warned < WARNINGS_PER_FILE:
            log.warning("%s: %s; %s", where, message, action)
        elif self.warned == WARNINGS_PER_FILE:
            log.warning(
                "%s: more problems not named here (all are counted, and listed under %s/)",
                self.path,
                PROBLEMS_DIR,
            )
        self.warned += 1


def too_large(note: Notes, line: int | None, size: int, limit: int, what: str) -> None:
    note("too_large", line, f"{what} of {size} bytes is over max_doc_bytes = {limit}", "skipped")


def decode(data: bytes, note: Notes, line: int | None, what: str) -> str | None:
    """Strict UTF-8, or None with the problem noted (line: of the first bad byte)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else data.count(b"\n", 0, e.start) + 1
        note("not_utf8", at, f"not UTF-8 ({e.reason} at byte {e.start})", f"{what} skipped")
        return None


def without_nul(text: str, note: Notes, line: int | None) -> str:
    if "\x00" in text:
        note("nul_chars", line, f"{text.count(chr(0))} NUL characters", "removed")
        text = text.replace("\x00", "")
    return text
