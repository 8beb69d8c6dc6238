"""What a recipe's `[[sources]]` table may say: its `name`, `kind` and `paths`, and the
options of how its files are read (`SourceOptions`)."""

from dataclasses import dataclass
from typing import Annotated

from megadata.settings import Check, PositiveInt

SOURCE_KINDS = ("text", "jsonl", "html", "wikipedia")
SOURCE_KEYS = ("name", "kind", "paths")  # required; the rest of the table is SourceOptions
DEFAULT_SPLIT_MB = 256  # megadata.file_pieces
DEFAULT_MAX_DOC_BYTES = 16 * 2**20  # 3x the crawler's page cap; Wikipedia's longest is ~1 MB


@dataclass(frozen=True)
class SourceOptions:
    """How the files of a source are read (the source's table less SOURCE_KEYS)."""

    split: str = "file"  # text: a document per "file", "line" or "paragraph"
    # A file over this many MB is read in pieces, a task each (megadata.file_pieces).
    split_mb: Annotated[float, Check("a number >= 0 (0: never split)", lambda v: v >= 0)] = (
        DEFAULT_SPLIT_MB
    )
    max_doc_bytes: PositiveInt = DEFAULT_MAX_DOC_BYTES  # a larger document is skipped whole


def options_table(table: dict) -> dict:
    """A `[[sources]]` table without SOURCE_KEYS: what SourceOptions is loaded from."""
    return {k: v for k, v in table.items() if k not in SOURCE_KEYS}
